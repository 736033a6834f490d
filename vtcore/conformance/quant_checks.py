"""The gate's quant section: every registered quant method against compressed-tensors, its packed-format oracle.

Two checks per method (compressed-tensors format):
- ``decode``: on random packed tensors (random codes, fp8/e8m0 scales, global scales), the method's
  float32 decode rounded to bf16 equals compressed-tensors' own ``decompress`` bit for bit;
- ``tokens``: each family's conformance model, quantized by compressed-tensors (``vtcore quantize``,
  the format's weight-only preset), greedy-decodes in vtcore like the dense float32 model its
  tensors decode to (the near-tie rule).
compressed-tensors is needed only here (never to load or run); without it both checks skip.
"""
from __future__ import annotations

import copy
import os
from typing import Any

import torch

from vtcore.conformance import QUANT_CHECKS
from vtcore.conformance.checks import BLOCK
from vtcore.conformance.results import CheckResult, Failed, Progress, Skipped, run_in_order
from vtcore.family import ModelFamily
from vtcore.plugins.manager import Plugins

#: compressed-tensors format -> its weight-only preset (what ``vtcore quantize`` writes)
PRESETS = {"nvfp4-pack-quantized": "NVFP4A16", "mxfp4-pack-quantized": "MXFP4A16"}
SEED = 0


def _random_tensors(fmt: str, group: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    n, k = 48, 8 * group
    packed = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    if fmt.startswith("nvfp4"):
        raw = torch.randint(0, 256, (n, k // group), generator=gen, dtype=torch.int32).to(torch.uint8)
        raw[(raw & 0x7F) == 0x7F] = 0x38  # no NaN scales: 1.0 instead
        glob = torch.rand(1, generator=gen) * 1000 + 1
        return {"weight_packed": packed, "weight_scale": raw.view(torch.float8_e4m3fn), "weight_global_scale": glob}
    scale = torch.randint(110, 140, (n, k // group), generator=gen, dtype=torch.int32).to(torch.uint8)
    return {"weight_packed": packed, "weight_scale": scale}


class QuantGate:
    """Runs the quant checks of one registered format against the given families."""

    def __init__(self, plugins: Plugins, fmt: str, families: list[ModelFamily], device: str, workdir: str,
                 left_out: list[str] = (), tensor_parallel_size: int = 1) -> None:
        self.plugins, self.fmt, self.families, self.device, self.workdir = plugins, fmt, families, device, workdir
        self.left_out = list(left_out)  # families that failed their own gate, named in the report
        self.tensor_parallel_size = tensor_parallel_size  # the ranks of the ``tokens`` check's engines
        self.results: dict[str, CheckResult] = {}

    @property
    def name(self) -> str:
        return self.fmt

    def run(self, progress: Progress | None = None) -> dict[str, CheckResult]:
        """Run every quant check in order, each result handed to ``progress`` as it ends."""
        return run_in_order(self.name, QUANT_CHECKS, self._run_check, self.results, progress)

    def _run_check(self, check: str) -> CheckResult:
        try:
            return CheckResult(check, "pass", getattr(self, "check_" + check)() or "")
        except Skipped as exc:
            return CheckResult(check, "skip", str(exc))
        except Failed as exc:
            return CheckResult(check, "fail", f"quant method {self.fmt!r}: {exc}")
        except Exception as exc:  # noqa: BLE001
            return CheckResult(check, "fail", f"quant method {self.fmt!r}: {check} raised {type(exc).__name__}: {exc}")

    def _oracle(self) -> Any:
        try:
            from compressed_tensors.compressors import BaseCompressor
            from compressed_tensors.quantization import preset_name_to_scheme
        except ImportError:
            raise Skipped("compressed-tensors (the packed-format oracle) is not installed") from None
        if self.fmt not in PRESETS:
            raise Skipped(f"no compressed-tensors preset known for format {self.fmt!r}")
        scheme = preset_name_to_scheme(PRESETS[self.fmt], ["Linear"])
        return BaseCompressor.get_value_from_registry(self.fmt), scheme

    def check_decode(self) -> str:
        compressor, scheme = self._oracle()
        group = int(scheme.weights.group_size)
        config = {"format": self.fmt, "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "float", "group_size": group}}}}
        method = self.plugins.quant_method(self.fmt)(config)
        gen = torch.Generator().manual_seed(SEED)
        for trial in range(4):
            tensors = _random_tensors(self.fmt, group, gen)
            ours = method.decode_weight(dict(tensors)).to(torch.bfloat16)
            theirs = compressor.decompress(dict(tensors), scheme)["weight"].to(torch.bfloat16)
            if not torch.equal(ours.view(torch.int16), theirs.view(torch.int16)):
                bad = int((ours.view(torch.int16) != theirs.view(torch.int16)).sum())
                raise Failed(f"decode differs from compressed-tensors' decompress in {bad} of {ours.numel()} "
                             f"weights (trial {trial}): check the nibble order, scale decoding and op order")
        return f"4 random {tuple(ours.shape)} tensors bit-exact in bf16"

    def check_tokens(self) -> str:
        group = int(self._oracle()[1].weights.group_size)
        from vtcore.conformance.harness import greedy, run_engine
        from vtcore.engine.llm import LLM
        from vtcore.tools.quantize import quantize_checkpoint
        from vtcore.testing.oracle import hf_model, near_tie_violations, random_prompt, save_checkpoint
        from vtcore.testing.quant_oracle import dense_oracle

        checked = []
        for family in self.families:
            example = self.plugins.pm.hook.vtcore_conformance_example(family=family)
            if example is None:
                continue
            hf = hf_model(example.hf_config, SEED, example.oracle)
            src = save_checkpoint(hf, os.path.join(self.workdir, f"{family.name}-dense"))
            dst = os.path.join(self.workdir, f"{family.name}-{PRESETS[self.fmt]}-tp{self.tensor_parallel_size}")
            dense = self._unsplittable(src, group)
            quantize_checkpoint(src, dst, PRESETS[self.fmt], ignore=dense, show_progress=False)
            oracle = dense_oracle(copy.deepcopy(hf), dst)
            engine = LLM(dst, device=self.device, dtype="float32", block_size=BLOCK, num_kv_blocks=128,
                         max_model_len=128, async_scheduling=False,
                         tensor_parallel_size=self.tensor_parallel_size).engine
            vocab = int(example.hf_config["vocab_size"])
            prompts = [random_prompt(n, SEED + n, vocab) for n in (1, BLOCK + 1, 3 * BLOCK)]
            try:
                tokens, _ = run_engine(engine, {0: [(str(i), p, greedy(12)) for i, p in enumerate(prompts)]})
            finally:
                engine.shutdown()
            for i, p in enumerate(prompts):
                bad = near_tie_violations(oracle, p, tokens[str(i)])
                if bad:
                    raise Failed(f"family {family.name!r} quantized with {PRESETS[self.fmt]}: greedy token at "
                                 f"position {bad[0][0]} differs from its decoded dense model beyond a near-tie")
            checked.append(family.name + (f" ({len(dense)} modules left dense: their part of an input at "
                                          f"tensor_parallel_size={self.tensor_parallel_size} splits a group)"
                                          if dense else ""))
        note = f" (left out, failing their own gate: {', '.join(self.left_out)})" if self.left_out else ""
        if not checked:
            raise Skipped(f"no family with a conformance example to quantize{note}")
        return f"{', '.join(checked)} agree with their decoded dense models{note}"

    def _unsplittable(self, src: str, group: int) -> list[str]:
        """The checkpoint modules of every layer one rank of ``tensor_parallel_size`` would hold a part of an
        input of that splits a group of ``group`` (a rank's part must hold whole groups): the gate leaves
        them dense rather than let the examples' tiny sizes decide which families it checks."""
        from vtcore.config import HFConfig
        from vtcore.layers.parallel import tensor_parallel
        from vtcore.layers.quantized import QuantTarget
        from vtcore.loading.model_loader import build_model

        if self.tensor_parallel_size == 1:
            return []
        with tensor_parallel(0, self.tensor_parallel_size):
            model, _ = build_model(src, HFConfig.from_path(src), torch.device("cpu"), torch.float32, 64, "dummy")
        dense = []
        for name, module in model.named_modules():
            if isinstance(module, QuantTarget):
                slots = module.quant_slots(name, model)
                if any(slot.spec.in_features % group for slot in slots):
                    dense += [m for slot in slots for m in slot.modules]
        return dense
