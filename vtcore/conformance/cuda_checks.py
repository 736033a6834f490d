"""The gate's CUDA checks: the decode CUDA graphs in float32 against the oracle, and bfloat16 by a rule.

On the GPU the engine decodes through CUDA graphs captured at start-up, one per padded batch
size; these checks drive batches that pad (1, 3 and 5 requests: sizes 1, 4 and 8) and require
that every pure-decode step was a graph replay. bfloat16 cannot meet float32 tolerances, so it is
held to transformers' own bfloat16 run: on the same token sequences, the mean absolute error of
the sampled-token logprobs against the float32 oracle may be at most ``BF16_RATIO`` times
transformers' bfloat16 error, plus ``BF16_SLACK``.
"""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch

from vtcore.conformance.harness import run_engine
from vtcore.conformance.results import Failed, Skipped
from vtcore.sampling_params import SamplingParams

if TYPE_CHECKING:
    from vtcore.engine.llm_engine import LLMEngine
    from vtcore.outputs import CompletionOutput

GRAPH_BATCHES = (1, 3, 5)
BF16_RATIO, BF16_SLACK = 2.0, 0.01


def _greedy_logprobs(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)


class CudaChecks:
    """Mixed into ``FamilyGate`` (its ``device``, ``engine``, ``prompts``, ``_checkpoint`` and
    ``_against_oracle``)."""

    device: str

    def _graph_cases(self, engine: "LLMEngine", max_tokens: int
                     ) -> tuple[list[tuple[str, list[int], SamplingParams, "CompletionOutput"]], str]:
        """Batches of ``GRAPH_BATCHES`` requests through ``engine``, each step recorded; fails unless
        every pure-decode step replayed a captured graph. Returns the cases and a summary."""
        runner = engine.runner
        graphs = runner.decode_graphs
        if not runner.captured_graphs:
            raise Failed("the engine captured no decode CUDA graphs: a module of the model without "
                         "supports_decode_graphs keeps it eager, so the served decode path is unchecked")
        decode_steps = 0
        sizes: set[int] = set()

        def observe(batch: list) -> None:
            nonlocal decode_steps
            if graphs.takes(batch):
                decode_steps += 1
                sizes.add(graphs.padded_size(len(batch)))

        cases = []
        prompts = self.prompts()
        before = runner.graph_replays
        for n in GRAPH_BATCHES:
            finals: dict[str, Any] = {}
            arrivals = {0: [(f"b{n}.{i}", prompts[i], _greedy_logprobs(max_tokens)) for i in range(n)]}
            run_engine(engine, arrivals, observe, finals)
            cases += [(rid, ids, params, finals[rid]) for rid, ids, params in arrivals[0]]
        replays = runner.graph_replays - before
        if decode_steps == 0 or replays != decode_steps:
            raise Failed(f"{replays} CUDA graph replays for {decode_steps} pure-decode steps: every decode step "
                         "must replay its padded graph")
        return cases, f"{replays} graph replays at padded sizes {sorted(sizes)}"

    def check_cuda_graphs(self) -> str:
        if self.device != "cuda":
            raise Skipped("runs with --device cuda")
        cases, summary = self._graph_cases(self.engine(), 12)
        self._against_oracle(cases)
        return f"float32: {summary}, every request within the oracle's tolerances"

    def check_cuda_bf16(self) -> str:
        from vtcore.testing.oracle import teacher_forced_logits

        if self.device != "cuda":
            raise Skipped("runs with --device cuda")
        _, hf = self._checkpoint()
        cases, summary = self._graph_cases(self.engine(dtype="bfloat16"), 12)
        hf16 = copy.deepcopy(hf).to("cuda", torch.bfloat16)
        ours: list[float] = []
        theirs: list[float] = []
        for _, prompt, _, out in cases:
            seq, start = prompt + list(out.token_ids[:-1]), len(prompt) - 1
            ref = torch.log_softmax(teacher_forced_logits(hf, seq)[start:].double(), -1)
            hf_lp = torch.log_softmax(teacher_forced_logits(hf16, seq)[start:].double().cpu(), -1)
            for pos, tok in enumerate(out.token_ids):
                ours.append(abs(out.logprobs[pos][tok].logprob - float(ref[pos, tok])))
                theirs.append(abs(float(hf_lp[pos, tok]) - float(ref[pos, tok])))
        ours_mean, hf_mean = sum(ours) / len(ours), sum(theirs) / len(theirs)
        bound = BF16_RATIO * hf_mean + BF16_SLACK
        if ours_mean > bound:
            raise Failed(f"bfloat16 logprobs are off the float32 oracle by {ours_mean:.3g} on average, transformers' "
                         f"own bfloat16 by {hf_mean:.3g} on the same tokens (allowed: {BF16_RATIO:g} x theirs + "
                         f"{BF16_SLACK:g} = {bound:.3g})")
        return f"bfloat16: {summary}; mean logprob error {ours_mean:.3g} vs transformers' bfloat16 {hf_mean:.3g} " \
               f"over {len(ours)} tokens"
