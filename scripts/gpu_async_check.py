"""Async engine on a GPU: async == sync under pressure, the race controls, and step times.

On a GPU machine, after `pip install --no-deps --no-build-isolation -e . -e plugins/qwen3_dense`:
    python scripts/gpu_async_check.py --out DIR
A Qwen3-0.6B-shaped model with dummy bfloat16 weights, greedy, ignore_eos, at batch 1, 3 (a padded graph
of 4) and 16, with decode CUDA graphs (``--enforce-eager``: without):
- sync, async (mirror on) and mirror-off give the same tokens; so do async runs with a
  `torch.cuda._sleep` before every sampler call and with each host staging buffer poisoned (-1)
  at the first moment the engine's guard lets it be reused;
- controls that must differ or raise: the staging buffer poisoned right after its upload is
  enqueued (guard skipped), a model that embeds the host ids (ignores the override), and the
  override withheld (the B arm); the device-assert arms run in subprocesses;
- no host sync inside `ModelRunner.submit` (torch's sync debug mode set to error there);
- the median wall time of one engine step in the decode phase for sync, async and mirror-off
  (batch 1 and 16), timed in a separate pass with the default (fast) kernels, the modes
  interleaved over 3 rounds, reported as the median of the rounds' medians.

Deterministic kernels are switched on (`torch.use_deterministic_algorithms`): without them two
sync runs of the same engine already differ at batch 16 (seen on an H200, 2026-11-30: logprobs
differing in the 4th decimal, then a flipped greedy token), which would make "async equals sync"
untestable. A warm-up run precedes the timed ones.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts: deterministic cuBLAS

import torch  # noqa: E402

torch.use_deterministic_algorithms(True)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from model_shapes import write_shape  # noqa: E402

MAX_TOKENS = 96
EAGER = False  # --enforce-eager: no CUDA graphs
SLEEP = {"sleep": 20_000_000}  # ~10 ms of GPU spin before every sampling (vtcore.testing.runner_probes)
MIRROR_OFF = {"mirror": False}


def checkpoint(tmp: str, arch: str = "Qwen3ForCausalLM") -> str:
    return write_shape(os.path.join(tmp, arch), "qwen3-0.6b", arch)


def prompts(batch: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return [torch.randint(0, 151936, (int(torch.randint(32, 200, (1,), generator=g)),), generator=g).tolist()
            for _ in range(batch)]


def run(path: str, batch: int, async_scheduling: bool, probes: dict | None = None,
        sync_debug: bool = False) -> tuple[list[list[int]], list[float], int]:
    """Tokens per request, per-step wall times (decode phase) and the override-consuming forwards.
    ``probes``: ``mirror`` (False: the rollback), ``poison`` ("early" / "guard") and ``sleep`` (GPU
    cycles before every sampling), installed by :mod:`vtcore.testing.runner_probes`."""
    from vtcore import LLM, SamplingParams
    from vtcore.testing.runner_probes import delay_sampling, poison_staging

    probes = probes or {}
    llm = LLM(path, device="cuda", load_format="dummy", async_scheduling=async_scheduling, num_kv_blocks=2048,
              max_model_len=1024, max_num_seqs=16, enforce_eager=EAGER, async_device_mirror=probes.get("mirror"))
    engine = llm.engine
    if "poison" in probes:
        poison_staging(engine.runner, probes["poison"])
    if "sleep" in probes:
        delay_sampling(engine.runner, probes["sleep"])
    if sync_debug:
        submit = engine.runner.submit

        def strict_submit(b):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return submit(b)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        engine.runner.submit = strict_submit
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, p in enumerate(prompts(batch)):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    tokens: dict[str, list[int]] = {}
    times = []
    torch.cuda.synchronize()
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
        times.append(time.perf_counter() - t0)
    consumed = engine.runner.consuming_forwards
    engine.runner.shutdown()
    del llm, engine
    torch.cuda.empty_cache()
    return [tokens[str(i)] for i in range(batch)], times[4:-4], consumed


def arm(name: str, batch: int) -> None:
    """Subprocess arms (a device-side assert kills the process)."""
    with tempfile.TemporaryDirectory() as tmp:
        if name == "control":  # the race widened by the sleep, and the guard skipped
            ref, _, _ = run(checkpoint(tmp), batch, False)
            got, _, _ = run(checkpoint(tmp), batch, True, {"poison": "early", **SLEEP})
        else:  # "ignore": a family whose embedding reads the host ids
            import importlib.metadata as md

            from vtcore.plugins.manager import Plugins, reset_plugins

            sys.path.insert(0, ROOT)
            reset_plugins(Plugins(entry_points=[*md.entry_points(group="vtcore"), md.EntryPoint(
                name="fixture_async", value="tests.fixture_async.families", group="vtcore")]))
            ref, _, _ = run(checkpoint(tmp), batch, False)
            got, _, _ = run(checkpoint(tmp, "IgnoresOverrideForCausalLM"), batch, True)
        torch.cuda.synchronize()
    print(json.dumps({"equal": got == ref}))


def subprocess_arm(name: str, batch: int) -> str:
    proc = subprocess.run([sys.executable, __file__, "--arm", name, "--batch", str(batch)], capture_output=True,
                          text=True, timeout=300)
    last = proc.stdout.strip().splitlines()[-1:] or [""]
    if proc.returncode != 0:
        err = [ln for ln in proc.stderr.splitlines() if "Error" in ln or "assert" in ln.lower()][-1:]
        return f"raised (rc={proc.returncode}: {err[0][:120] if err else ''})"
    return "DIFFERS" if '"equal": false' in last[0] else "EQUAL (control failed to bite)"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--arm", default=None)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--timing-only", action="store_true", help="skip the correctness checks")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds per mode")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (default: decode graphs on)")
    args = ap.parse_args()
    global EAGER
    EAGER = args.enforce_eager
    if args.arm:
        arm(args.arm, args.batch)
        return 0
    from vtcore.errors import DeviceTokenOverrideIgnored

    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "max_tokens": MAX_TOKENS,
                    "cuda_graphs": not EAGER}
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        path = checkpoint(tmp)
        run(path, 4, False)  # warm-up: allocator, cuBLAS handles, clocks
        for batch in () if args.timing_only else (1, 3, 16):
            ref, t_sync, _ = run(path, batch, False)
            rows = {"sync": (True, t_sync)}
            for mode, asyn, probes, dbg in (
                    ("async", True, {}, True), ("mirror-off", True, MIRROR_OFF, False),
                    ("async+sleep", True, SLEEP, False),
                    ("async+poison-at-guard", True, {"poison": "guard"}, False),
                    ("async+sleep+poison-at-guard", True, {"poison": "guard", **SLEEP}, False)):
                try:
                    got, times, consumed = run(path, batch, asyn, probes, sync_debug=dbg)
                    rows[mode] = (got == ref, times)
                    if mode == "async":
                        report[f"b{batch}_consuming_forwards"] = consumed
                except Exception as exc:  # a sync inside submit, or anything else: report it
                    rows[mode] = (f"raised {type(exc).__name__}: {exc}"[:200], [0.0])
            for mode, (equal, times) in rows.items():
                med = statistics.median(times) * 1e3
                report[f"b{batch}_{mode}"] = {"equal_to_sync": equal, "median_step_ms": round(med, 3)}
                ok &= equal is True
                print(f"batch={batch:<3} {mode:<28} equal_to_sync={equal!s:<6} median step {med:8.3f} ms")
            # B arm in-process: the override withheld must raise before any device work.
            from vtcore import LLM, SamplingParams

            llm = LLM(path, device="cuda", load_format="dummy", num_kv_blocks=256, max_model_len=1024)
            from vtcore.testing.runner_probes import withhold_override

            withhold_override(llm.engine.runner)
            try:
                llm.generate([{"prompt_token_ids": p} for p in prompts(batch)],
                             SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
                b_arm = "EQUAL (B arm failed to bite)"
            except DeviceTokenOverrideIgnored as exc:
                b_arm = f"raised DeviceTokenOverrideIgnored: {exc}"[:120]
            llm.engine.runner.shutdown()
            del llm
            for name, res in (("B-withheld", b_arm), ("control-sleep+poison-early", subprocess_arm("control", batch)),
                              ("ignores-override", subprocess_arm("ignore", batch))):
                report[f"b{batch}_{name}"] = res
                ok &= not res.startswith("EQUAL")
                print(f"batch={batch:<3} {name:<28} {res}")
    torch.use_deterministic_algorithms(False)
    with tempfile.TemporaryDirectory() as tmp:
        path = checkpoint(tmp)
        run(path, 4, False)
        for batch in (1, 16):
            rounds: dict[str, list[float]] = {"sync": [], "async": [], "mirror-off": []}
            for _ in range(args.rounds):
                for mode, asyn, probes in (("sync", False, {}), ("async", True, {}),
                                        ("mirror-off", True, MIRROR_OFF)):
                    rounds[mode].append(statistics.median(run(path, batch, asyn, probes)[1]) * 1e3)
            timing = {m: round(statistics.median(v), 3) for m, v in rounds.items()}
            report[f"b{batch}_timing_ms"] = {**timing, "rounds": rounds}
            print(f"batch={batch:<3} timing (median of {args.rounds} interleaved rounds, ms/step): {timing}; "
                  f"sync/async = {timing['sync'] / timing['async']:.2f}")
    if args.out:
        with open(os.path.join(args.out, "gpu_async_check.json"), "w") as f:
            json.dump(report, f, indent=2)
    print("ALL CHECKS PASSED" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
