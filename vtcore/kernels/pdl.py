"""Programmatic dependent launch (PDL, sm_90 and later) for the decode-path kernels.

A batch-1 decode step is a chain of short launches back to back (GEMVs, attention, norms: design.md,
"Decode launches"), so each launch's start-up (program scheduling, index math, the first memory
round trip) is a visible share of it. Launched with PDL (Triton's ``launch_pdl``), a kernel's
programs may be scheduled while the kernel before it on the stream is still finishing.

Correctness does not depend on it: every kernel launched so calls :func:`wait_prior` before it
touches memory another kernel writes (its first statement, except that the one-row GEMV first
requests its first weight tile: weights are no kernel's output); ``griddepcontrol.wait`` returns
only once the kernel before has completed and its writes are visible, so nothing is read or
written early (the shared arrival counters of :mod:`vtcore.kernels.workspace` included). Right after the wait, ``griddepcontrol.launch_dependents``
lets the next kernel be scheduled in turn: at most one kernel waits ahead, not a cascade. A kernel
launched without PDL (a torch op, or PDL off) starts only after the one before has finished, as
usual; both instructions are no-ops then. CUDA graph capture keeps the programmatic edges.

On by default on CUDA devices of compute capability 9.0 and later; ``VTCORE_PDL=0`` turns it off
(the peer in ``scripts/gpu_pdl_check.sh``); the interpreter never uses it.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

__all__ = ["pdl_launch", "wait_prior", "ENV"]

ENV = "VTCORE_PDL"


@functools.cache
def _enabled(index: int) -> bool:
    setting = os.environ.get(ENV, "1").strip().lower()
    if setting not in ("0", "1", "false", "true", "off", "on"):
        raise ValueError(f"{ENV}={os.environ[ENV]!r}: expected 1 (programmatic dependent launch where the GPU "
                         "has it) or 0 (off)")
    return setting in ("1", "true", "on") and torch.cuda.get_device_capability(index) >= (9, 0)


def pdl_launch(device: torch.device) -> dict[str, bool]:
    """Keyword arguments for a launch on ``device`` of a kernel taking ``PDL: tl.constexpr``:
    ``PDL`` and Triton's ``launch_pdl`` both on where PDL is used, else ``PDL=False`` alone."""
    if device.type != "cuda" or not _enabled(device.index if device.index is not None else torch.cuda.current_device()):
        return {"PDL": False}
    return {"PDL": True, "launch_pdl": True}


@triton.jit
def wait_prior(PDL: tl.constexpr):
    """A PDL kernel's first statement: wait for the kernel before (its writes visible), then let
    the next one be scheduled."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
