"""The hostile schedule: requests arriving while others decode, prefills chunked and mixed with
decode rows, a KV pool small enough to preempt, blocks and state slots reused.

The schedule depends only on prompt lengths and max_tokens (every request ignores EOS), never on
the family, so ``ScheduleLog`` can prove each feature happened; a run without one is a gate error.
"""
from __future__ import annotations

import random

import attrs

from vtcore.conformance.harness import Arrivals
from vtcore.engine.scheduler import Batch
from vtcore.sampling_params import SamplingParams

#: Engine knobs of the hostile schedule (with the gate's 8-token blocks): 10 tokens a step split
#: prompts mid-block; 9 blocks (72 tokens) cannot hold the requests running at once; 4 seats make
#: later arrivals take freed slots.
KNOBS = {"max_num_batched_tokens": 10, "num_kv_blocks": 9, "max_num_seqs": 4}
#: (arrival step, prompt tokens, max_tokens, sampled) per request
REQUESTS = ((0, 21, 12, False), (0, 3, 20, False), (0, 13, 6, True), (3, 1, 9, False), (5, 26, 8, False),
            (8, 9, 14, True), (12, 17, 5, False), (16, 5, 16, False), (28, 1, 6, False))
FEATURES = ("chunked prefill", "prefill mixed with decode rows", "preemption", "a block reused",
            "a state slot reused")
#: What a request went through, and what a family gets wrong there, for failure messages.
HINTS = {
    "chunked": "prefilled in chunks (a prefill chunk must attend over the KV, and continue the state, "
               "already cached for its request, not only its own tokens)",
    "slot": "given a state slot another request had used (state must start from zero where a request's first "
            "scheduled token is position 0: has_state / state_continues False)",
    "preempted": "preempted and recomputed from prompt and output so far",
    "block": "given KV blocks that had held another request's KV",
}


def hostile_arrivals(vocab_size: int, seed: int) -> Arrivals:
    """``REQUESTS`` with seeded random prompts; sampled ones at temperature 1, seeded; all with logprobs."""
    rng = random.Random(seed)
    arrivals: Arrivals = {}
    for i, (at, n, max_tokens, sampled) in enumerate(REQUESTS):
        params = SamplingParams(temperature=1.0 if sampled else 0.0, seed=seed + i, max_tokens=max_tokens,
                                ignore_eos=True, logprobs=0)
        arrivals.setdefault(at, []).append((f"s{i}", [rng.randrange(vocab_size) for _ in range(n)], params))
    return arrivals


@attrs.define
class ScheduleLog:
    """What the scheduled batches did, fed by ``run_engine``'s ``observe``."""

    seen: set[str] = attrs.Factory(set)
    events: dict[str, set[str]] = attrs.Factory(dict)  # request id -> keys of HINTS
    block_owner: dict[int, str] = attrs.Factory(dict)
    slot_owner: dict[int, str] = attrs.Factory(dict)

    def _event(self, rid: str, event: str, feature: str) -> None:
        self.events.setdefault(rid, set()).add(event)
        self.seen.add(feature)

    def __call__(self, batch: Batch) -> None:
        prefill = [s.start < s.request.num_prompt_tokens or s.num_tokens > 1 for s in batch]
        if any(prefill) and not all(prefill):
            self.seen.add("prefill mixed with decode rows")
        for s, is_prefill in zip(batch, prefill):
            rid = s.request.request_id
            if is_prefill and s.start > 0:
                self._event(rid, "chunked", "chunked prefill")
            if s.request.num_preemptions:
                self._event(rid, "preempted", "preemption")
            for block in s.request.block_ids:
                if self.block_owner.setdefault(block, rid) != rid:
                    self._event(rid, "block", "a block reused")
                    self.block_owner[block] = rid
            if self.slot_owner.setdefault(s.request.mirror_slot, rid) != rid:
                self._event(rid, "slot", "a state slot reused")
                self.slot_owner[s.request.mirror_slot] = rid

    def missing(self) -> list[str]:
        return [f for f in FEATURES if f not in self.seen]

    def hint(self, rids: list[str], of: int) -> str:
        """What every one of the requests ``rids`` (of the ``of`` the schedule ran) went through (else what the
        first did), each with what a family may get wrong there; where every request differs, that the schedule
        singles nothing out (what all went through points at nothing)."""
        if len(rids) == of:
            return f"all {of} requests differ, whatever the schedule did to each: a fault it does not single out"
        each = [self.events.get(rid, set()) for rid in rids]
        common = set.intersection(*each) or each[0]
        said = "; ".join(text for key, text in HINTS.items() if key in common) or "run beside late arrivals"
        return f"{'all ' if len(rids) > 1 else ''}{len(rids)} request(s) it differs on were {said}"
