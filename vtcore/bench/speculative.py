"""``vtcore bench --speculative-config JSON``: what a verify step costs and what speculation can gain.

At each ``--concurrency`` c, the same c random prompts (``--input-len``, greedy, ``ignore_eos``,
``--output-len`` tokens) are decoded as one batch by fresh engines, each step timed on the host around
``LLMEngine.step`` (the engine is synchronous with speculation, so a step's time is its host and device
work; ``time.perf_counter``):

* ``plain``: no speculation, at the family's default async depth (what a user gets without
  speculation; a step's time is then the step-to-step time). Its decode steps' median time, and its
  TPOT: the decode steps' total time over the tokens each request got from them (``output_len - 1``).
* ``replay`` at each k of ``--speculative-k`` (default 1..8): the benchmark-only replay proposer
  (:mod:`vtcore.spec.replay`) proposes the plain run's own continuation, and the run is teacher-forced
  (:class:`TeacherForcing`: the host takes the recorded tokens as sampled), so every proposal is
  accepted. Forcing is needed because a verify row's logits come from other kernels than a decode
  row's (M-row GEMMs and the prefill attention instead of one-row GEMVs), and dummy bf16 weights,
  whose logits are nearly flat, flip near-ties between the two within a few tokens; after a flip
  the recorded continuation is no longer the request's. ``target_agreement``: the share of sampled
  positions where the target's own token was the recorded one. Its verify steps' median time beside
  the plain step's (``verify_over_plain``; ``padded_verify_steps``: how many ran on the padded path CUDA graphs
  capture), its TPOT and ``speedup`` (plain TPOT / its TPOT): the
  bound on what speculation at that k can gain. Where the configured method drafts on the device (the
  n-gram with ``--async-scheduling``) the replay does too (:mod:`vtcore.bench.device_replay`: forced and
  drafted on the device, at async depth 2, in the padded paths), so the bound is the device path's;
  otherwise the replay runs synchronously.
* ``method``: the configured proposer itself (e.g. ``ngram``, real acceptance on real weights such as
  the embedded default model): acceptance rate, mean acceptance length, TPOT and speedup, and
  ``outputs_equal`` (its tokens are the plain run's; in bf16 a near-tie may flip, as above).
* With ``"method": "mtp"`` the replay runs keep the model's MTP head running after every step (its
  drafts unused), so their verify steps carry its cost; ``mtp_head_ms`` is the head's own median time a
  step (its pass over the step's rows and its chain; CUDA events on CUDA), in every run. A draft model
  drafting on the device (``draft_model`` with ``--async-scheduling``) is timed the same way in the
  ``method`` run (printed as "drafter").

Also in the same run: the roofline (the device copy bandwidth, measured before any engine is built,
and the bytes a plain decode step must move; see :mod:`vtcore.bench.roofline`).
"""
from __future__ import annotations

import gc
import random
import statistics
import time
from typing import Any, Callable, Sequence

import attrs

from vtcore.config import EngineConfig
from vtcore.spec.stats import SpecDecodeStats

DEFAULT_KS = (1, 2, 3, 4, 5, 6, 7, 8)
WARM_UP_TOKENS = 16


@attrs.define
class TimedRun:
    """One batch decoded to completion: each request's tokens and the decode-like steps' times."""

    tokens: list[list[int]]
    decode_steps: list[float]  # every row decodes (one fed token; a verify row with its draft)
    verify_steps: list[float]  # of those, the steps in which some row verified a draft
    padded_verify_steps: int = 0  # verify steps the runner ran on the padded path (CUDA graphs on CUDA)

    def tpot(self, output_len: int) -> float | None:
        return sum(self.decode_steps) / (output_len - 1) if output_len > 1 else None


def _collect() -> None:
    """After the last reference to an engine went: free its weights, caches and graphs before the next."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def timed_run(engine: Any, prompts: Sequence[list[int]], output_len: int, tag: str) -> TimedRun:
    """Decode ``prompts`` as one batch on ``engine`` (an LLMEngine), timing every step."""
    from vtcore.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    seen: list[Any] = []

    def observe(batch: Any, done: bool) -> None:
        if not done:
            seen.append(batch)

    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": ids}, params)
    engine.runner.on_submit.append(observe)
    padded0 = engine.runner.padded_verify_steps
    tokens: dict[str, list[int]] = {}
    decode: list[float] = []
    verify: list[float] = []
    try:
        while engine.has_unfinished_requests():
            seen.clear()
            t0 = time.perf_counter()
            outs = engine.step()
            dt = time.perf_counter() - t0
            for out in outs:
                if out.finished:
                    tokens[out.request_id] = list(out.outputs[0].token_ids)
            batch = seen[0] if seen else []
            if batch and all(s.samples and s.num_tokens == 1 + len(s.draft) and
                             s.start >= s.request.num_prompt_tokens for s in batch):
                decode.append(dt)
                if any(s.draft for s in batch):
                    verify.append(dt)
    finally:
        engine.runner.on_submit.remove(observe)
    return TimedRun([tokens[f"{tag}-{i}"] for i in range(len(prompts))], decode, verify,
                    engine.runner.padded_verify_steps - padded0)


@attrs.define
class TeacherForcing:
    """Makes a synchronous engine's host take the recorded tokens as the ones it sampled, counting how
    many the target itself sampled (``agreed`` of ``sampled``). The device work is unchanged, so the
    steps cost what steps of all-accepted proposals cost."""

    sequences: dict[tuple[int, ...], list[int]]  # prompt -> prompt and recorded continuation
    sampled: int = 0
    agreed: int = 0

    def install(self, engine: Any) -> None:
        if engine.depth != 1:
            raise ValueError("teacher forcing rewrites each step's tokens before the next step is prepared: "
                             f"it needs a synchronous engine, not async depth {engine.depth}")
        runner = engine.runner
        batches: list[Any] = []
        publish = runner.publish

        def observe(batch: Any, done: bool) -> None:
            if not done:
                batches.append(batch)

        def forced(out: dict[str, Any], event: Any) -> Any:
            result = publish(out, event)
            tokens, row = result.token_ids, 0
            for s in batches.pop(0):
                req = s.request
                seq = self.sequences[tuple(req.token_ids[:req.num_prompt_tokens])]
                first = s.start + s.num_tokens - len(s.draft)  # the position of the first sampled token
                for i in range(s.num_sampled):
                    if first + i < len(seq):
                        self.sampled += 1
                        self.agreed += tokens[row] == seq[first + i]
                        tokens[row] = seq[first + i]
                    row += 1
            return result

        runner.on_submit.append(observe)
        runner.publish = forced

    @property
    def agreement(self) -> float | None:
        return self.agreed / self.sampled if self.sampled else None


def _median_ms(xs: list[float]) -> float | None:
    return statistics.median(xs) * 1e3 if xs else None


def run_speculative(config: EngineConfig, concurrency: Sequence[int], ks: Sequence[int], input_len: int,
                    output_len: int, copy_mib: int, build: Callable[[EngineConfig], Any]) -> dict[str, Any]:
    """Every engine and concurrency of the sweep (``config.speculative_config`` names the method);
    ``build`` makes an LLMEngine from a config."""
    from vtcore.bench.roofline import (decode_step_bytes, kv_bytes_per_token, measure_copy_bandwidth,
                                       parameter_bytes, roofline_for_run)
    from vtcore.engine.llm_engine import resolve_device
    from vtcore.bench.device_replay import DeviceReplay
    from vtcore.engine.llm_engine import drafts_on_device
    from vtcore.spec.replay import ReplayProposer

    spec = config.speculative_config
    if spec is None:
        raise ValueError("the speculative benchmark needs --speculative-config")
    copy = measure_copy_bandwidth(resolve_device(config.device), copy_mib)
    plain_engine = build(attrs.evolve(config, speculative_config=None))
    vocab = plain_engine.vocab_size
    rng = random.Random(config.seed)
    prompts = {c: [[rng.randrange(vocab) for _ in range(input_len)] for _ in range(c)] for c in concurrency}

    def measure(engine: Any, forcing: "TeacherForcing | DeviceReplay | None" = None
                ) -> dict[int, tuple[TimedRun, SpecDecodeStats, float | None, float | None]]:
        """Per concurrency: the timed run, the proposals counted in it alone, (teacher-forced) the share of
        its sampled tokens the target itself sampled as recorded, and an MTP head's median time a step."""
        runs = {}
        drafter = engine.runner.mtp
        for c in concurrency:  # untimed first: lazy setup and kernel compilation (a prefix of the same run)
            timed_run(engine, prompts[c], min(output_len, WARM_UP_TOKENS), f"warm{c}")
            engine.spec_stats = counted = SpecDecodeStats(len(engine.spec_stats.accepted_per_position))
            if forcing is not None:
                forcing.sampled = forcing.agreed = 0
            if drafter is not None:
                drafter.timings = []
            run = timed_run(engine, prompts[c], output_len, f"c{c}")
            head = statistics.median(drafter.timed_ms()) if drafter is not None and drafter.timings else None
            runs[c] = run, counted, forcing.agreement if forcing is not None else None, head
            engine.spec_stats = SpecDecodeStats(len(counted.accepted_per_position))
        return runs

    plain = {c: run for c, (run, *_) in measure(plain_engine).items()}
    param_bytes = {c: parameter_bytes(plain_engine.runner.model, c) for c in concurrency}
    kv_per_token = kv_bytes_per_token(plain_engine.runner.attention_layers, plain_engine.dtype)
    device, dtype, plain_depth = plain_engine.device, plain_engine.dtype, plain_engine.depth
    del plain_engine
    _collect()
    sequences = [p + t for c in concurrency for p, t in zip(prompts[c], plain[c].tokens)]
    depths: dict[bool, int] = {}  # replay or not -> the engine's async depth

    replay_on_device = spec.method == "ngram" and drafts_on_device(config)

    def speculative(k: int, replay: bool) -> dict[int, tuple[TimedRun, SpecDecodeStats, float | None, float | None]]:
        knobs: dict[str, Any] = {"speculative_config": {**attrs.asdict(spec), "num_speculative_tokens": k}}
        if replay and not replay_on_device:  # teacher forcing rewrites each step's tokens on the host
            knobs["async_scheduling"] = False
        engine = build(attrs.evolve(config, **knobs))
        depths[replay] = engine.depth
        forcing: TeacherForcing | DeviceReplay | None = None
        recorded = {tuple(s[:input_len]): s for s in sequences}
        if replay and replay_on_device:
            forcing = DeviceReplay(recorded, engine)
        elif replay:
            engine.scheduler.proposer = ReplayProposer(sequences, vocab)
            engine.scheduler.device_drafts = False  # an MTP head still runs (and is timed), its drafts unused
            forcing = TeacherForcing(recorded)
            forcing.install(engine)
        runs = measure(engine, forcing)
        del engine
        _collect()
        return runs

    replays = {k: speculative(k, True) for k in ks}
    configured = speculative(spec.num_speculative_tokens, False)
    out_runs = []
    for c in concurrency:
        base = plain[c]
        plain_step = _median_ms(base.decode_steps)
        plain_tpot = base.tpot(output_len)

        def entry(k: int, run: TimedRun, stats: SpecDecodeStats, agreement: float | None, head_ms: float | None
                  ) -> dict[str, Any]:
            step = _median_ms(run.verify_steps)
            tpot = run.tpot(output_len)
            return {"k": k, "verify_steps": len(run.verify_steps), "padded_verify_steps": run.padded_verify_steps,
                    "verify_step_ms": step,
                    "verify_over_plain": step / plain_step if step and plain_step else None,
                    "tpot_ms": tpot * 1e3 if tpot else None,
                    "speedup": plain_tpot / tpot if tpot and plain_tpot else None,
                    "acceptance_rate": stats.acceptance_rate, "mean_acceptance_length": stats.mean_acceptance_length,
                    "accepted_per_position": list(stats.accepted_per_position),
                    "outputs_equal": run.tokens == base.tokens, "target_agreement": agreement,
                    "mtp_head_ms": head_ms}

        step_bytes = decode_step_bytes(param_bytes[c], kv_per_token, c, input_len, output_len)
        out_runs.append({
            "concurrency": c, "plain_decode_steps": len(base.decode_steps), "plain_step_ms": plain_step,
            "plain_tpot_ms": plain_tpot * 1e3 if plain_tpot else None,
            "roofline": roofline_for_run(step_bytes, copy["bandwidth_bytes_s"], plain_tpot),
            "replay": [entry(k, *replays[k][c]) for k in ks],
            "method": entry(spec.num_speculative_tokens, *configured[c]),
        })
    return {"mode": "speculative", "device": str(device), "dtype": str(dtype).replace("torch.", ""),
            "method": spec.method, "speculative_config": attrs.asdict(spec), "input_len": input_len,
            "output_len": output_len, "ks": list(ks), "timer": "time.perf_counter",
            "enforce_eager": config.enforce_eager, "plain_async_depth": plain_depth,
            "method_async_depth": depths[False], "replay_async_depth": depths[True], "runs": out_runs,
            "roofline": {"kv_bytes_per_token": kv_per_token, "copy_bandwidth_bytes_s": copy["bandwidth_bytes_s"],
                         "copy": copy}}


def format_speculative(doc: dict[str, Any]) -> str:
    """The printed table: per concurrency, the plain step, then each replay k and the configured method."""
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    def ratio(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}x"

    lines = [f"speculative decoding ({doc['method']}), {doc['device']} {doc['dtype']}, input {doc['input_len']}, "
             f"output {doc['output_len']} tokens, enforce_eager={doc['enforce_eager']}, plain run at async depth "
             f"{doc['plain_async_depth']} (replay runs: {doc.get('replay_async_depth', 1)}, "
             f"{doc['method']}: {doc.get('method_async_depth', 1)})"]
    for r in doc["runs"]:
        lines.append(f"c={r['concurrency']}: plain decode step {ms(r['plain_step_ms'])} ms, TPOT "
                     f"{ms(r['plain_tpot_ms'])} ms (roofline {r['roofline']['roofline_ms']:.3f} ms a step)")
        drafter = "MTP head" if doc["method"] == "mtp" else "drafter"
        for e in r["replay"] + [r["method"]]:
            name = "replay" if e is not r["method"] else doc["method"]
            rate, length = e["acceptance_rate"], e["mean_acceptance_length"]
            lines.append(f"  {name:>6} k={e['k']}: verify step {ms(e['verify_step_ms'])} ms "
                         f"({ratio(e['verify_over_plain'])} plain; {e['padded_verify_steps']} of {e['verify_steps']} "
                         f"padded), TPOT {ms(e['tpot_ms'])} ms, speedup "
                         f"{ratio(e['speedup'])}, acceptance {'-' if rate is None else f'{100 * rate:.1f}%'}, "
                         f"mean length {'-' if length is None else f'{length:.2f}'}, " + (
                             f"target's own tokens as recorded {100 * e['target_agreement']:.1f}%"
                             if e["target_agreement"] is not None else
                             f"tokens {'equal to' if e['outputs_equal'] else 'NOT equal to'} plain's")
                         + ("" if e.get("mtp_head_ms") is None else f", {drafter} {ms(e['mtp_head_ms'])} ms a step"))
    return "\n".join(lines) + "\n"
