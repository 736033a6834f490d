"""The gate's structured-outputs check: constrained greedy decoding, sync and async, against the oracle.

The example models ship no tokenizer, and a grammar is over text: the gate trains a byte-level BPE of
the example's vocabulary size on ``CORPUS`` (its own, saved beside the checkpoint and handed to the
engine as ``tokenizer``) and constrains requests to a choice, a regex and a JSON schema over it. Each
output is replayed through a fresh matcher of its constraint: every token must be allowed, and be the
oracle's argmax over the allowed tokens (teacher-forced, near-ties within the gate's tolerance); an
output that stopped must have ended its grammar (the matcher accepted the stop token). Async (a
constrained row whose previous token is still in flight is drawn late, from the logits its step
computed with the device-token override) must give sync's tokens and finish reasons, and must have
drawn rows late. (Its batches may hold one step more of a request whose stop token was in flight,
as for any request that stops on a token.)
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from vtcore.conformance.harness import run_engine
from vtcore.conformance.results import Failed, Skipped
from vtcore.sampling_params import SamplingParams
from vtcore.structured import StructuredOutputsParams

if TYPE_CHECKING:
    from vtcore.engine.llm_engine import LLMEngine
    from vtcore.outputs import CompletionOutput

EOS = "<|endoftext|>"
#: the text the gate's tokenizer is trained on (every merge it learns comes from here)
CORPUS = ('{"id": 17, "name": "ab", "ok": true} {"id": 3, "name": "cab", "ok": false} red green blue '
          "abc-12 bca-7 cab-301 [1, 2, 3] ") * 20
CONSTRAINTS = [
    StructuredOutputsParams(choice=["red", "green", "blue"]),
    StructuredOutputsParams(regex="[a-c]{2,4}-[0-9]{1,3}"),
    StructuredOutputsParams(json={"type": "object", "properties": {"id": {"type": "integer", "minimum": 0,
                                                                         "maximum": 99}},
                                  "required": ["id"], "additionalProperties": False}),
]
MAX_TOKENS = 24


def gate_tokenizer(vocab_size: int, folder: str) -> str:
    """A byte-level BPE of at most ``vocab_size`` tokens (``EOS`` the first), trained on ``CORPUS`` and
    saved in ``folder`` (as transformers loads it), unless it is there already; returns ``folder``."""
    if os.path.isfile(os.path.join(folder, "tokenizer.json")):
        return folder
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # (no progress: the trainer writes it to the process's stdout, the gate's table, whatever that is)
    tok.train_from_iterator([CORPUS], trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                          show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS).save_pretrained(folder)
    return folder


class StructuredChecks:
    """Mixed into ``FamilyGate`` (its ``family``, ``engine``, ``prompts``, ``workdir``, ``_checkpoint``,
    ``oracle`` and the gate's tolerance)."""

    def _masked_violation(self, hf: Any, prompt: list[int], out: "CompletionOutput", constraint: Any,
                          grammars: Any, tol: float, strict: bool = False) -> str | None:
        """What is wrong with a constrained greedy ``out`` under the oracle ``hf`` (None: nothing); an output
        that stopped must leave its grammar terminated. ``strict`` also refuses an oracle whose logits over
        the allowed tokens are flat at a position (with two or more allowed: a degenerate oracle agrees with
        anything)."""
        import xgrammar as xgr

        from vtcore.kernels.bitmask import unpack_bitmask
        from vtcore.testing.oracle import teacher_forced_logits

        ids = list(out.token_ids)
        if not ids:
            return "no token generated"
        matcher = grammars.matcher(constraint).matcher
        lp = torch.log_softmax(teacher_forced_logits(hf, prompt + ids[:-1])[len(prompt) - 1:].double(), -1)
        mask = xgr.allocate_token_bitmask(1, grammars.tokens)
        for pos, tok in enumerate(ids):
            matcher.fill_next_token_bitmask(mask)
            allowed = unpack_bitmask(mask, lp.shape[1])[0]
            if not allowed[tok]:
                return f"token {tok} at position {pos} is outside the grammar of {constraint.key()[0]}"
            masked = lp[pos].masked_fill(~allowed, float("-inf"))
            top = int(masked.argmax())
            if strict and int(allowed.sum()) > 1 and float(masked[top] - lp[pos][allowed].min()) <= tol:
                return "flat"
            gap = float(masked[top] - masked[tok])
            if tok != top and gap > tol:
                return f"constrained greedy tokens differ from {self.oracle}'s argmax over the grammar's tokens " \
                       f"beyond near-ties: prompt of {len(prompt)} tokens, position {pos}: ours {tok}, oracle {top} " \
                       f"(logit gap {gap:.3g})"
            matcher.accept_token(tok)
        if out.finish_reason == "stop" and not matcher.is_terminated():
            return f"the output stopped before its {constraint.key()[0]} grammar was complete"
        return None

    def check_structured(self) -> str:
        from vtcore.conformance.checks import LOGPROB_TOL
        from vtcore.conformance.sensitivity import likely_cause

        vocab = int(self.example.hf_config["vocab_size"])
        if vocab < 257:
            raise Skipped(f"the example's vocabulary of {vocab} tokens is too small for a byte-level tokenizer")
        tokenizer = gate_tokenizer(vocab, os.path.join(self.workdir, f"tokenizer-{vocab}"))  # shared by families
        _, hf = self._checkpoint()
        prompts = self.prompts()
        arrivals = {0: [(f"s{i}", prompts[i % len(prompts)],
                         SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=c))
                        for i, c in enumerate(CONSTRAINTS)]}
        modes = ("sync", "async") if self.family.consumes_device_tokens else ("sync",)
        runs: dict[str, Any] = {}
        for mode in modes:
            engine: LLMEngine = self.engine(mode, tokenizer=tokenizer)
            finals: dict[str, CompletionOutput] = {}
            run_engine(engine, arrivals, finals=finals)
            runs[mode] = {rid: (list(o.token_ids), o.finish_reason) for rid, o in finals.items()}
            grammars = engine._grammars()
            cases = [(rid, prompt, finals[rid], c) for (rid, prompt, _), c in zip(arrivals[0], CONSTRAINTS)]
            wrong = {rid: why for rid, prompt, out, c in cases
                     if (why := self._masked_violation(hf, prompt, out, c, grammars, LOGPROB_TOL))}
            if wrong:  # (a reset named only where it explains every request: one alone can be a coincidence)
                cause = likely_cause(hf, lambda m: all(
                    self._masked_violation(m, prompt, out, c, grammars, LOGPROB_TOL, strict=True) is None
                    for _, prompt, out, c in cases))
                rid = next(iter(wrong))
                raise Failed(f"{mode}: request {rid!r}: {wrong[rid]}" + cause)
            if mode == "async" and not engine.runner.late_draws:
                raise Failed("async drew no constrained row late: every row's previous token had landed, so the "
                             "late path went unchecked (a vtcore bug, not the family's)")
        if len(runs) > 1 and runs["async"] != runs["sync"]:
            bad = sorted(rid for rid in runs["sync"] if runs["async"].get(rid) != runs["sync"][rid])
            raise Failed(f"async differs from sync for constrained request {bad[0]!r}: {runs['async'].get(bad[0])} vs "
                         f"{runs['sync'][bad[0]]}: a row drawn late samples the logits its own step computed, with the "
                         "in-flight token from the device mirror")
        return f"{len(CONSTRAINTS)} constrained greedy requests (choice, regex, JSON schema) over a {vocab}-token " \
               f"byte-level BPE: every token the oracle's argmax over the grammar's tokens" \
               f"{', async (rows drawn late) equal to sync' if len(runs) > 1 else ''}"
