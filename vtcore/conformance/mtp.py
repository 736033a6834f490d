"""The speculative check's MTP pass: a family's own multi-token-prediction head drafting in the engine.

The example checkpoints come from transformers, which has no MTP head: the gate builds the family's head
(``vtcore_mtp_head``; a family without one skips the pass), gives it random weights and saves them as
``mtp.*`` beside a copy of the oracle checkpoint. Requests then decode through verify rows of the head's
drafts, sync, prefill cut into chunks: every continuation is teacher-forced against the oracle (a draft,
right or wrong, must leave no trace), and every draft the engine keeps for a request must be what the same
head gives when run from scratch over the request's tokens (``vtcore.testing.mtp``), bar near-ties. The
second part is what a random head can check: that the head reads the right hidden states and next
tokens, at the right positions, and finds its own KV from earlier steps where it wrote it.

Then the device path of the drafts (``vtcore.conformance.device_drafts``): async equal to sync, and drafts
replayed so that verify rows accept every count.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file

from vtcore.conformance.device_drafts import staggered
from vtcore.conformance.harness import run_engine
from vtcore.conformance.results import Failed
from vtcore.config import HFConfig
from vtcore.errors import NoMTPHead
from vtcore.loading.model_loader import build_model
from vtcore.testing.mtp import head_drafts_from_scratch

if TYPE_CHECKING:
    from vtcore.outputs import CompletionOutput

K = 3  # draft tokens a step
NEAR_TIE = 1e-3  # a from-scratch draft whose logit leads the next by less is not compared (nor the chain after it)
MIN_COMPARED = 20  # drafts the pass must have compared


class MTPChecks:
    """Mixed into ``FamilyGate`` (its ``name``, ``device``, ``workdir``, ``engine``, ``_checkpoint``,
    ``_against_oracle`` and ``_device_drafts_pass``): ``_mtp_pass`` for its speculative check."""

    def _mtp_pass(self, prompts: list[list[int]], block: int, chunk: int) -> str | None:
        """None when the family has no MTP head; else the pass's report (raises ``Failed``). ``block``: the
        engines' block size; ``chunk``: their max_num_batched_tokens."""
        path = self._mtp_checkpoint()
        if path is None:
            return None
        hf = HFConfig(json.load(open(os.path.join(path, "config.json"))))
        reference, _ = build_model(path, hf, torch.device(self.device), torch.float32, 128, "safetensors", mtp=True)
        knobs = {"path": path, "speculative_config": {"method": "mtp", "num_speculative_tokens": K},
                 "max_num_batched_tokens": chunk, "enable_prefix_caching": False}
        arrivals = staggered(prompts, 16)
        cases = [c for batch in arrivals.values() for c in batch]
        engine = self.engine("sync", **knobs)
        compared, step = [0], engine.step

        def checked_step() -> list[Any]:
            before = {rid: list(r.proposed) for rid, r in engine.requests.items()}
            outs = step()
            for rid, req in engine.requests.items():
                if req.proposed and req.proposed != before.get(rid) and not req.is_finished:
                    self._same_drafts(reference, rid, req.token_ids, req.proposed, block, compared)
            return outs

        engine.step = checked_step  # type: ignore[method-assign]
        finals: dict[str, CompletionOutput] = {}
        head = run_engine(engine, arrivals, finals=finals)
        self._against_oracle([(*c, finals[c[0]]) for c in cases],
                             lambda rids: f" (MTP drafts; requests {rids} decoded through verify rows)")
        if compared[0] < MIN_COMPARED:
            raise Failed(f"MTP: only {compared[0]} drafts were compared with the head run from scratch (the gate "
                         f"needs {MIN_COMPARED}): the engine kept too few drafts (a vtcore bug)")
        return f"MTP head: {engine.spec_stats.num_drafts} verify rows, {compared[0]} drafts equal to the head run " \
               f"from scratch; {self._device_drafts_pass('MTP', 'sync', knobs, arrivals, head)}"

    def _same_drafts(self, reference: Any, rid: str, tokens: list[int], drafts: list[int], block: int,
                     compared: list[int]) -> None:
        for i, (got, (want, margin)) in enumerate(zip(drafts, head_drafts_from_scratch(reference, tokens, K, block))):
            if margin < NEAR_TIE:
                return
            if got != want:
                raise Failed(f"MTP: request {rid!r} after {len(tokens)} tokens drafted {drafts}, the head run from "
                             f"scratch over its tokens gives {want} at draft position {i}: the head must read, at "
                             "each position, the target's final-norm hidden state and the next token, and attend "
                             "over its own KV at the request's true positions (MultiTokenPredictor)")
            compared[0] += 1

    def _mtp_checkpoint(self) -> str | None:
        """A copy of the oracle checkpoint with random ``mtp.*`` tensors of the family's head, or None."""
        path, _ = self._checkpoint()
        target = os.path.join(self.workdir, f"{self.name}-mtp")
        if os.path.isdir(target):
            return target
        hf = HFConfig(json.load(open(os.path.join(path, "config.json"))))
        try:
            model, _ = build_model(path, hf, torch.device("cpu"), torch.float32, 128, "dummy", seed=7, mtp=True)
        except NoMTPHead:
            return None
        shutil.copytree(path, target)
        tensors = load_file(os.path.join(target, "model.safetensors"))
        tensors.update({f"mtp.{k}": v.contiguous() for k, v in model.mtp.state_dict().items()})
        save_file(tensors, os.path.join(target, "model.safetensors"))
        return target
