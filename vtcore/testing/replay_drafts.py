"""Replayed drafts on the device path: a test double for a device drafter that proposes well.

An MTP head with random weights (the gate's, a test's) has nearly nothing accepted, and the device n-gram
little on random prompts, so the shifts of a floating share (``Scheduled.floats``: positions, KV slots, the
state resumed after the last accepted token) would be tried with few accepted counts. ``replay_device_drafts``
keeps the drafter running (an MTP head's KV and its cost, the n-gram's history) and then replaces each
greedy request's draft on the device with what followed its tokens in a recorded greedy run, one token
changed in a cycle (``ReplayProposer(reject_every=True)``), so verify rows accept every count from 0 to k,
through exactly the path the drafter's own drafts take.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Sequence

import torch

from vtcore.spec.replay import ReplayProposer


def replay_device_drafts(engine: Any, sequences: Sequence[Sequence[int]]) -> None:
    """Install on ``engine`` (drafting on the device, on CPU, sync or async): ``sequences`` are the prompt and
    greedy continuation of each request to replay (requests with no sequence keep the drafter's drafts)."""
    runner = engine.runner
    proposer = ReplayProposer(sequences, engine.vocab_size, reject_every=True)
    k = runner.device_drafts.shape[1]
    submitted: deque[dict[int, list[int]]] = deque()  # per step, in submit order: mirror slot -> prompt
    drafter = runner._draft

    def observe(batch: Any, done: bool) -> None:
        if not done:
            submitted.append({s.request.mirror_slot: s.request.prompt_token_ids for s in batch if s.samples})

    def replayed(out: dict[str, Any], f: Any, tokens: torch.Tensor, width: int, max_context_len: int
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
        proposed = drafter(out, f, tokens, width, max_context_len)
        prompts = submitted.popleft()  # device work runs in submit order
        if proposed is None:
            return None
        drafts, accepted = proposed  # (device tensors: ``out`` holds their host copies, maybe still in flight)
        base, first = f.draft_sections[1], f.draft_sections[2]
        slots = f.sample_slots[first]
        positions = f.positions[base + accepted].tolist()
        replaced = drafts.tolist()
        for i, (slot, position) in enumerate(zip(slots.tolist(), positions)):
            seq = next((s for s in proposer.sequences if s[:len(prompts[slot])] == prompts[slot]), None)
            draft = [] if seq is None else proposer.propose(seq[:position + 2], k)  # (its row, the token sampled)
            replaced[i][:len(draft)] = draft
        drafts = torch.tensor(replaced, dtype=drafts.dtype, device=drafts.device).view(drafts.shape)
        runner.device_drafts[slots] = drafts
        out["drafts"] = runner._to_host(drafts)
        return drafts, accepted

    runner.on_submit.append(observe)
    runner._draft = replayed
