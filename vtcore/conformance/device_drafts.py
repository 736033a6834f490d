"""The speculative check's passes over drafts made on the device (an MTP head, the n-gram with async
scheduling), where the next step is scheduled before a verify row's accepted count reaches the host.

A request's share right after its verify row floats: its positions, KV slots and context length are
shifted on the device by the accepted count, and its stateful layers resume from the state after the last
accepted token. Each pass runs the same requests (half arriving while the others decode) on the reference
engine, which follows the same rules one step at a time, and on the async engine: both within the oracle's
tolerances, async building the reference's batches and tokens; then once more with each draft replaced on
the device by the recorded greedy continuation with one token changed in a cycle
(``vtcore.testing.replay_drafts``), so that verify rows accept every count from none to all.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from vtcore.conformance.harness import greedy, run_engine
from vtcore.conformance.results import Failed
from vtcore.testing.replay_drafts import replay_device_drafts

if TYPE_CHECKING:
    from vtcore.outputs import CompletionOutput

FLOATING_HINT = (": the share after a verify row is scheduled before its accepted count is known, and runs at "
                 "positions, KV slots and context lengths shifted on the device, with its stateful layers' state "
                 "restored to the one after its last accepted token: a layer must take all of them from the "
                 "step's device tensors and its slot, never from host copies; these steps and a lone prompt chunk "
                 "take the padded paths, where a stateful layer must leave a chunk's rows past "
                 "AttentionMetadata.state_tokens out of its state; a verify row's state after each token goes to "
                 "its state_out_slots entry (general path) or state_out_index slot (padded path)")


#: the step a last request arrives at, when the others have finished: it decodes alone (batch 1)
LONE_ARRIVAL = 64


def staggered(prompts: list[list[int]], max_tokens: int) -> dict[int, list[tuple[str, list[int], Any]]]:
    """Request i with ``prompts[i]``, greedy; the odd ones arrive two steps later, while the others decode,
    and one more with the last prompt once they all have finished (it runs alone)."""
    arrivals = {at: [(str(i), p, greedy(max_tokens)) for i, p in enumerate(prompts) if i % 2 == at // 2]
                for at in (0, 2)}
    arrivals[LONE_ARRIVAL] = [("lone", prompts[-1], greedy(max_tokens))]
    return arrivals


class DeviceDraftChecks:
    """Mixed into ``FamilyGate`` (its ``engine`` and ``_against_oracle``)."""

    def _device_drafts_pass(self, label: str, reference: str, knobs: dict[str, Any],
                            arrivals: dict[int, list[tuple[str, list[int], Any]]],
                            first: tuple[dict[str, list[int]], list] | None = None,
                            min_acceptance: float = 0.0) -> str:
        """``label``'s pass (module doc) on engines built with ``knobs``: ``reference`` the engine mode the
        async one must equal; ``first`` that engine's run already made (tokens, batches), else run here;
        ``min_acceptance``: the share of its own drafts the async run must have accepted."""
        cases = [c for batch in arrivals.values() for c in batch]

        padded: list[int] = []  # the async runs' verify steps on the padded path
        drafter_replays: list[int] = []  # their drafter's graph replays (an MTP head, a draft model; CUDA)

        def run(mode: str, replay: list[list[int]] | None = None) -> tuple[tuple[dict, list], Any]:
            engine = self.engine(mode, **knobs)
            if replay is not None:
                replay_device_drafts(engine, replay)
            finals: dict[str, CompletionOutput] = {}
            got = run_engine(engine, arrivals, finals=finals)
            what = f"{label}{', replayed' if replay else ''}, {mode}"
            self._against_oracle([(*c, finals[c[0]]) for c in cases],
                                 _context(f" ({what}; requests {{}} decoded through verify rows){FLOATING_HINT}"))
            if mode == "async" and engine.runner.verify_graphs is not None:
                padded.append(engine.runner.padded_verify_steps)
                if engine.runner.drafter_graphs and engine.runner.captured_graphs:
                    drafter_replays.append(engine.runner.drafter_graph_replays)
            return got, engine.spec_stats

        ref = first if first is not None else run(reference)[0]
        got, stats = run("async")
        if got != ref:
            raise Failed(f"{label} async: other batches or tokens than {reference}{FLOATING_HINT}")
        drafted = (stats.num_drafts, stats.num_accepted_tokens)
        if stats.num_accepted_tokens < min_acceptance * stats.num_draft_tokens or not stats.num_drafts:
            raise Failed(f"{label} async: {stats.num_accepted_tokens} of {stats.num_draft_tokens} drafted tokens "
                         f"accepted in {stats.num_drafts} verify rows, below {min_acceptance:.0%}")
        sequences = [p + ref[0][rid] for rid, p, _ in cases]
        (replayed, _), (again, stats) = run(reference, sequences), run("async", sequences)
        per_position, rows = stats.accepted_per_position, stats.num_drafts
        if not 0 < per_position[-1] < per_position[0] < rows:
            raise Failed(f"{label}: replayed drafts accepted {per_position} tokens per position in {rows} verify "
                         "rows, not every count (a vtcore bug)")
        if again != replayed:
            raise Failed(f"{label} async with replayed drafts: other batches or tokens than {reference}{FLOATING_HINT}")
        if padded and not all(padded):
            raise Failed(f"{label} async: verify steps on the padded path {padded} (a run without any: the padded "
                         "path of drafts made on the device went untested; a vtcore bug)")
        if drafter_replays and not all(drafter_replays):
            raise Failed(f"{label} async: the drafter replayed its graphs in {drafter_replays} steps (a run without "
                         "any: the captured drafter after padded steps went untested; a vtcore bug)")
        where = f" ({' and '.join(map(str, padded))} verify steps on the padded path)" if padded else ""
        where += f" ({' and '.join(map(str, drafter_replays))} drafter graph replays)" if drafter_replays else ""
        return (f"{label} async: {drafted[0]} verify rows, {drafted[1]} tokens accepted, equal to {reference}; "
                f"replayed: {rows} verify rows accepting {per_position} a position, async equal to {reference}"
                f"{where}")


def _context(template: str) -> Callable[[list[str]], str]:
    return lambda rids: template.format(rids)
