"""Continuous batching with chunked prefill under a token budget, and preemption by recompute.

One scheduler serves the sync and the async engine. Each step spends at most
``max_num_batched_tokens`` tokens: running requests first (a decode token each, or the next chunk
of a prefill), oldest first, then waiting requests in arrival order while at most
``max_num_seqs`` run. When the block pool runs dry, the newest running request is preempted: its
blocks are freed and it re-enters the queue to recompute prompt and output so far. ``add``
rejects what could never fit, so preemption always makes progress. Under the priority policy
(vLLM's ``scheduling_policy="priority"``) "oldest" and "arrival order" read "by (priority, arrival)":
both queues are kept in that order, so the request preempted is the lowest-priority newest one.

Prefix caching (``BlockPool.caching``): a request admitted with nothing computed (new, or preempted)
starts from the longest chain of cached blocks its known tokens match, never its last token (whose
logits are needed), and not at all when it asks for prompt logprobs (its lookup hashes blocks up to the first
one not cached). After each schedule, once the engine has enqueued the step (``register_computed``: the hashes
are host work the device need not wait for), the full blocks of every running request up to
``min(computed, scheduled - 2)`` tokens become findable. Right
after a schedule the host may not know a request's last two tokens: the one the step samples and, in
the async engine, the one before it still in flight; every other token is known in both engines at
the same step, so both register the same blocks and build the same batches.

Hybrid families (a ``SnapshotPool``): a cached prefix also needs every stateful layer's state at its
end. A request asks for a snapshot at every multiple of the pool's ``interval`` its scheduled tokens
reach (``Scheduled.saves``); the snapshot is registered with the block that ends its prefix. At
admission the matched blocks are cut back to the longest prefix whose snapshot exists, and the first
share restores it (``Scheduled.restore``).

Speculative decoding: a verify row's accepted draft tokens are settled into ``num_computed_tokens`` by the
schedule after the one that follows its step's application in the async engine (``settle_after`` batches
later), never by the application itself, so both engines count the same at every schedule (``Request.lag``).
With drafts made on the device (an MTP head) a request's share right after its verify row *floats*
(``Scheduled.floats``): the host schedules it at the position it would have with no draft token accepted,
its blocks reaching the most it could need, and the runner shifts its positions by the accepted count on
the device; its drafts come from the device too. So the async engine schedules a request every step
without seeing its accepted tokens, and the sync engine builds the very same batches. Host proposers
(n-gram, draft model) need a request's tokens, so they run with the sync engine only, settling each verify
row at the next schedule.

Async: a step is scheduled before the previous one's tokens reach the host. ``num_computed_tokens``
advances at scheduling time and each sampling step adds one in-flight token, so a decode row can
be scheduled for a token the host has not seen (the runner fills it on the device). A request whose
in-flight tokens reach its known end (max_tokens, max_model_len) leaves the scheduler at once
(``DRAINING``): it frees its blocks and seat exactly when the sync engine would, so both engines
build the same batches. Freed blocks are reusable at once because all device work is ordered on
one stream: a later step's writes always land after an earlier step's.
"""
from __future__ import annotations

import bisect
import time
from collections import deque
from typing import Callable

from vtcore.engine.block_pool import BlockPool
from vtcore.engine.capacity import Buckets
from vtcore.engine.request import Request, RequestStatus, Verify
from vtcore.engine.snapshot_pool import SnapshotPool
from vtcore.spec.proposer import Proposer
from vtcore.errors import RequestRejected
from vtcore.worker.bad_words import read_outputs
from vtcore.worker.step import DEVICE_DRAFT, Batch, Scheduled

__all__ = ["Batch", "Scheduled", "Scheduler"]

#: a request's tokens the host may not know right after a schedule (the one sampled, one in flight)
_UNKNOWN_AFTER_SCHEDULE = 2


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 snapshots: SnapshotPool | None = None, proposer: Proposer | None = None,
                 num_speculative_tokens: int = 0, device_drafts: bool = False, lookahead: int = 0,
                 by_priority: bool = False) -> None:
        """``proposer``: asked for drafts each step; ``device_drafts``: instead the drafts are made on the
        device in the step before (an MTP head, the device n-gram); ``lookahead``: tokens past what a step
        computes that a request's blocks reach, up to its own end (an MTP head's draft chain writes there);
        ``by_priority``: the priority policy."""
        self.pool = pool
        self.snapshots = snapshots
        self.proposer = proposer
        self.device_drafts = device_drafts
        self.lookahead = lookahead
        self.num_speculative_tokens = num_speculative_tokens
        #: schedules so far, empty ones too: at schedule ``steps`` every batch scheduled at ``steps - 2`` or before
        #: has been applied in both engines (in the sync engine the last one too)
        self.steps = 0
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.by_priority = by_priority
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        #: ended (device drafts): seat, blocks and mirror slot kept until its verify rows settle, as the async
        #: engine, which may not have seen its count yet, keeps them
        self.ending: list[Request] = []
        self.free_mirror_slots = list(range(max_num_seqs - 1, -1, -1))
        self.num_preemptions = 0
        self.step_tokens = Buckets()  # tokens (drafts included) of each non-empty batch

    def add(self, req: Request) -> None:
        """Queue a request, or reject it (naming both numbers) if it can never be served."""
        if req.num_prompt_tokens >= self.max_model_len:
            raise RequestRejected(f"request {req.request_id!r}: prompt has {req.num_prompt_tokens} tokens, "
                                  f"but max_model_len={self.max_model_len} leaves no room to generate")
        longest = req.num_prompt_tokens + req.max_output
        need = self.pool.blocks_needed(longest)
        if need > self.pool.num_blocks:
            raise RequestRejected(f"request {req.request_id!r}: up to {longest} tokens need {need} KV blocks, "
                                  f"but the pool holds {self.pool.num_blocks} (raise num_kv_blocks or lower max_tokens)")
        self._insert(self.waiting, req, self.waiting.append)

    def _insert(self, queue: deque[Request] | list[Request], req: Request,
                first_come: Callable[[Request], None]) -> None:
        """Put ``req`` into ``queue``: by (priority, arrival) under the priority policy, else by ``first_come``
        (the queue's append or appendleft)."""
        if self.by_priority:
            bisect.insort(queue, req, key=_rank)
        else:
            first_come(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.ending)

    def _leave_running(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)

    def _release(self, req: Request) -> None:
        self.pool.free(req.block_ids)
        req.num_registered_blocks = 0
        self._drop_snapshots(req)
        self.free_mirror_slots.append(req.mirror_slot)
        req.mirror_slot = -1

    def _reuse_prefix(self, req: Request) -> None:
        """Start ``req`` (nothing computed, no blocks) from its longest cached prefix."""
        if not self.pool.caching or req.params.prompt_logprobs is not None:
            return
        bs = self.pool.block_size
        hashes = self.pool.hashes(req.token_ids, req.block_hashes, (req.num_tokens - 1) // bs, req.cache_salt,
                                  until_uncached=True)
        blocks = self.pool.match(hashes)
        if self.snapshots is not None:  # only as far as a snapshot of every layer's state exists
            keep = self._restorable(req, hashes, len(blocks))
            self.pool.free(blocks[keep:])
            del blocks[keep:]
        req.block_ids = blocks
        req.num_registered_blocks = len(blocks)
        req.num_computed_tokens = len(blocks) * bs

    def _restorable(self, req: Request, hashes: list[bytes], matched: int) -> int:
        """The most of ``matched`` blocks ending where a snapshot exists (its slot: ``req.restore_snapshot``)."""
        per = self.snapshots.interval // self.pool.block_size
        for keep in range(matched // per * per, 0, -per):
            slot = self.snapshots.find(hashes[keep - 1])
            if slot is not None:
                req.restore_snapshot = slot
                return keep
        return 0

    def _snapshot_saves(self, req: Request, start: int, n: int) -> tuple[tuple[int, int], ...]:
        """Snapshot slots for the interval multiples in ``(start, start + n]`` (none once the pool is short)."""
        saves = []
        interval = self.snapshots.interval
        for end in range((start // interval + 1) * interval, start + n + 1, interval):
            slot = self.snapshots.take()
            if slot is None:
                break
            req.pending_snapshots.append((end, slot))
            saves.append((end - start, slot))
        return tuple(saves)

    def _drop_snapshots(self, req: Request) -> None:
        """Hand back the snapshots ``req`` took and never registered (it leaves, or its admission failed)."""
        if self.snapshots is not None:
            for _, slot in req.pending_snapshots:
                self.snapshots.release(slot)
        req.pending_snapshots.clear()
        req.restore_snapshot = -1

    def _register(self, req: Request) -> None:
        """Make ``req``'s computed full blocks findable (tokens the host knows in sync and async alike)."""
        if req.num_computed_tokens // self.pool.block_size <= req.num_registered_blocks and not req.pending_snapshots:
            return  # no block filled since the last call (most steps of a decoding request)
        known = min(req.num_tokens_scheduled - _UNKNOWN_AFTER_SCHEDULE, req.num_tokens)  # the latter: a guard
        full = min(req.num_computed_tokens, known) // self.pool.block_size
        done = req.num_registered_blocks
        if full > done:
            hashes = self.pool.hashes(req.token_ids, req.block_hashes, full, req.cache_salt)
            self.pool.cache(req.block_ids[done:full], hashes[done:full])
            req.num_registered_blocks = full
        pending = req.pending_snapshots
        while pending and pending[0][0] <= full * self.pool.block_size:
            end, slot = pending.pop(0)
            self.snapshots.register(slot, req.block_hashes[end // self.pool.block_size - 1])

    def _preempt(self, req: Request) -> None:
        self._leave_running(req)
        req.num_computed_tokens = 0
        req.resume_draft_state = -1  # the recompute starts from zero state
        req.verifies.clear()  # (their tokens land in token_ids all the same)
        req.drafted = False
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._insert(self.waiting, req, self.waiting.appendleft)

    def _ahead(self, req: Request, tokens: int) -> int:
        """The tokens ``req``'s blocks must hold after a step computing up to ``tokens``: ``lookahead`` more
        where its own end leaves room (past it no token is ever computed; ``add`` checked the pool holds it)."""
        end = min(self.max_model_len, req.num_prompt_tokens + req.max_output)
        return max(tokens, min(tokens + self.lookahead, end))

    def _may_end(self, req: Request) -> bool:
        """Whether ``req``'s unsettled verify row can reach its output limit (all its drafts accepted)."""
        return bool(req.floats_over) and req.num_outputs_scheduled + req.floats_over >= req.max_output

    @property
    def settle_after(self) -> int:
        """Batches a verify row waits before it is settled: with device drafts the next share floats over it."""
        return 2 if self.device_drafts else 1

    def _settle(self, req: Request) -> None:
        """Count the accepted draft tokens of ``req``'s verify rows scheduled ``settle_after`` batches ago or
        earlier (both engines have applied them); a stateful layer resumes from the state after the last
        accepted token, unless a floating share already did that on the device."""
        while req.verifies and req.verifies[0].step <= self.steps - self.settle_after:
            v = req.verifies.pop(0)
            req.num_computed_tokens += v.accepted or 0  # (None: its step failed, the request was aborted)
            if not v.floated and v.accepted < v.drafts:
                req.resume_draft_state = v.accepted

    def _proposals(self) -> dict[str, tuple[int, ...]]:
        """Drafts for every running decode row that can take them: up to k tokens each, at most what its
        output limit leaves after the token the row samples anyway (and after the unsettled verify row it
        floats over, if it accepts all). Host proposers: one call for the rows whose tokens the host knows.
        Device drafts: placeholders (``DEVICE_DRAFT``) for the rows of requests whose head has drafted and
        whose sampling reads no history (penalties, min_tokens not reached: a floating row's history is on
        the device)."""
        if self.proposer is None and not self.device_drafts:
            return {}
        rows = []
        for r in self.running:
            if r.status != RequestStatus.RUNNING or r.grammar is not None \
                    or r.num_tokens_scheduled - r.num_computed_tokens != 1:
                continue
            ready = _reads_no_history(r) and r.drafted if self.device_drafts else not r.num_inflight
            if not ready:
                continue
            k = min(self.num_speculative_tokens, r.max_output - r.num_outputs_scheduled - 1 - r.floats_over)
            if k > 0:
                rows.append((r, k))
        if self.device_drafts:
            return {r.request_id: (DEVICE_DRAFT,) * k for r, k in rows}
        drafts = self.proposer.propose_batch([(r.token_ids, k) for r, k in rows]) if rows else []
        return {r.request_id: tuple(d[:k]) for (r, k), d in zip(rows, drafts)}

    def _take(self, req: Request, n: int, draft: tuple[int, ...] = ()) -> Scheduled:
        """``req``'s share of this batch: ``n`` of its tokens (those it has to compute, up to the budget), then
        ``draft``; a share right after an unsettled verify row of its request floats over it (its draft tokens
        count once settled)."""
        over = req.verifies[0] if req.verifies else None  # (the one left after _settle, of the last batch)
        start = req.num_computed_tokens
        req.num_computed_tokens += n
        samples = req.num_computed_tokens == req.num_tokens_scheduled
        if samples:
            req.num_inflight += 1
            req.drafted = True
        verify = None
        if draft:
            verify = Verify(self.steps, len(draft))
            req.verifies.append(verify)
        floats = 0
        if over is not None:
            over.floated, floats = True, over.drafts
        resume, req.resume_draft_state = req.resume_draft_state, -1
        if self.snapshots is None:
            return Scheduled(req, start, n + len(draft), samples, draft=draft, resume=resume, floats=floats,
                             verify=verify)
        restore, req.restore_snapshot = req.restore_snapshot, -1  # snapshots of verified tokens only, at
        saves = () if floats else self._snapshot_saves(req, start, n)  # positions the host knows
        return Scheduled(req, start, n + len(draft), samples, restore, saves, draft, resume, floats, verify)

    def _release_ended(self) -> None:
        """Requests whose end the host knows leave (``DRAINING``: their last token may be in flight), and ended
        ones whose verify rows have all settled free their seat, blocks and slot; with device drafts all in
        arrival order, the same in both engines (the order freed blocks are evicted in)."""
        drained = [r for r in self.running if r.host_knows_end and r.num_computed_tokens >= r.num_tokens]
        for req in drained:
            req.status = RequestStatus.DRAINING
        leaving = drained + [r for r in self.ending if not r.verifies]
        if self.device_drafts:
            leaving.sort(key=lambda r: r.arrival)
        for req in leaving:
            (self.ending if req.status == RequestStatus.FINISHED else self.running).remove(req)
            self._release(req)

    def schedule(self) -> Batch:
        for req in self.running + self.ending:
            if req.verifies:
                self._settle(req)
        self._release_ended()
        budget = self.max_num_batched_tokens
        batch: Batch = []
        preempted = False
        proposals = self._proposals()
        for req in list(self.running):
            if budget == 0:
                break
            if req.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if req.grammar is not None and req.grammar.masked < req.num_output_tokens + req.num_inflight:
                continue  # its in-flight token is not drawn yet (a late row): the forward would read no token
            if req.verifies and self._may_end(req):
                continue  # it waits for its count, which the sync engine has seen (and may have ended it on)
            n = min(req.num_tokens_scheduled - req.num_computed_tokens, budget)
            if n <= 0:
                continue
            draft = proposals.get(req.request_id, ())[:budget - 1] if n == 1 else ()
            most = req.num_computed_tokens + req.floats_over + n + len(draft)
            while not self.pool.grow(req.block_ids, self._ahead(req, most)):
                victim = next(r for r in reversed(self.running) if r is req or not self._may_end(r))
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.status == RequestStatus.RUNNING:
                batch.append(self._take(req, n, draft))
                budget -= n + len(draft)
        seats = self.max_num_seqs - len(self.ending)
        while not preempted and self.waiting and budget > 0 and len(self.running) < seats:
            req = self.waiting[0]
            if req.num_inflight:
                break  # preempted with a token in flight: it returns once that token has landed
            if not req.block_ids:
                self._reuse_prefix(req)
            n = min(req.num_tokens_scheduled - req.num_computed_tokens, budget)
            if not self.pool.grow(req.block_ids, self._ahead(req, req.num_computed_tokens + n)):
                self.pool.free(req.block_ids)  # the cached prefix too: looked up again next time
                req.num_computed_tokens = req.num_registered_blocks = 0
                req.restore_snapshot = -1
                break
            self.waiting.popleft()
            if not req.num_preemptions:  # first admission: when, and what the cache held
                req.scheduled_ts = time.monotonic()
                if self.pool.caching:
                    req.num_cached_tokens = req.num_computed_tokens
                    self.pool.queries += req.num_prompt_tokens
                    self.pool.hits += req.num_computed_tokens
            req.status = RequestStatus.RUNNING
            req.mirror_slot = self.free_mirror_slots.pop()
            self._insert(self.running, req, self.running.append)
            batch.append(self._take(req, n))
            budget -= n
        self.steps += 1
        if batch:
            self.step_tokens.observe(self.max_num_batched_tokens - budget)
        return batch

    def register_computed(self) -> None:
        """Make the full blocks computed by the steps scheduled so far findable (their hashes are host work:
        the engine calls this once a step's device work is enqueued, before the next schedule looks them up)."""
        if self.pool.caching:
            for req in self.running + self.ending:
                self._register(req)

    def finish(self, req: Request, reason: str) -> None:
        """End a request: free its blocks and seat at once (device work is ordered on one stream), or, with
        device drafts, at the next schedule once its verify rows have settled (``ending``; the async engine
        may not know yet that it ended)."""
        if req.status == RequestStatus.RUNNING and self.device_drafts:
            self.running.remove(req)
            self.ending.append(req)
        elif req.status == RequestStatus.RUNNING:
            self._leave_running(req)
        elif req.status == RequestStatus.WAITING and req in self.waiting:
            self.waiting.remove(req)
            self.pool.free(req.block_ids)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason


def _rank(req: Request) -> tuple[int, int]:
    """A request's place under the priority policy: lower priority values first, then arrival."""
    return req.priority, req.arrival


def _reads_no_history(req: Request) -> bool:
    """Whether ``req``'s sampling reads none of its earlier tokens (no penalties, no bad word of several ids,
    min_tokens reached)."""
    p = req.params
    return p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty \
        and req.num_outputs_scheduled >= p.min_tokens and not read_outputs(req.bad_words)
