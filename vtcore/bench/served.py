"""``vtcore bench --serve``: the served path beside the engine, in one run.

``vtcore serve`` is started in a child process on the bench's engine config (its flags and the bench's
own defaults, written back as flags; loopback, a free port); the closed loop of
:mod:`vtcore.bench.http` runs against it, one concurrency at a time, with the server's own ``/metrics``
read before and after each (after an untimed warm-up of ``c`` short requests; the timed loop then sends
none of its own, so each stream's first request also opens its connection); the server is stopped
(SIGTERM), then the in-process bench (:func:`vtcore.bench.serving.run_bench`) runs the same grid, so one
engine holds the device at a time. Prompts are random ids of the same lengths in both (no prefix is
shared), the same share of them held to the bench's schema (``--structured-share``).

Where the served time goes, per concurrency: the server's mean time from a request's arrival (its body
parsed) to its first token, from its histogram's sum and count, splits the client's mean TTFT into the
part outside the server (HTTP, the request's parse, the client) and the part inside it; the in-process
mean TTFT is what the engine alone takes.
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

from vtcore.bench.cpu_share import CpuMeter
from vtcore.bench.http import client_processes, run_http
from vtcore.engine.arg_utils import engine_argv
from vtcore.engine.compile_watch import MARK

#: how long ``vtcore serve`` may take to answer /health (loading and capturing graphs included)
START_TIMEOUT_S = 600.0
TTFT_METRIC = "vtcore:time_to_first_token_seconds"
STEP_TOKENS_METRIC = "vtcore:iteration_tokens_total"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, log_path: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            with open(log_path, errors="replace") as f:
                tail = f.read()[-2000:]
            raise RuntimeError(f"--serve: vtcore serve exited with status {proc.returncode} before it served:\n{tail}")
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"--serve: vtcore serve did not answer {url}/health within {START_TIMEOUT_S:.0f} s")


def histogram_totals(metrics_text: str, name: str) -> tuple[float, float]:
    """(sum, count) of the histogram ``name`` in a Prometheus text body (0, 0 when absent)."""
    total = {"_sum": 0.0, "_count": 0.0}
    for line in metrics_text.splitlines():
        for suffix in total:
            if line.startswith(name + suffix + "{") or line.startswith(name + suffix + " "):
                total[suffix] += float(line.rsplit(" ", 1)[1])
    return total["_sum"], total["_count"]


def _server_totals(url: str) -> tuple[tuple[float, float], tuple[float, float]]:
    """(sum, count) of the server's TTFT histogram and of its engine's tokens-per-step histogram."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return histogram_totals(text, TTFT_METRIC), histogram_totals(text, STEP_TOKENS_METRIC)


def run_seeds(seed: int, concurrency: int) -> tuple[int, int]:
    """The (warm-up, timed) prompt seeds of one concurrency: prompts and a shared prefix of the concurrency's own, as
    in-process, and a warm-up drawing others (the same prefix would be cached before the timed run starts)."""
    timed = seed * 1_000_003 + concurrency
    return -1 - timed, timed


def run_served(args: argparse.Namespace, concurrency: list[int], input_len: int, progress: bool) -> dict[str, Any]:
    """Served, then in-process; the --json document (``served``: the HTTP runs, each with the server's own
    mean TTFT; ``inprocess``: the in-process bench's document)."""
    from vtcore.bench.serving import bench_engine_config, run_bench

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "vtcore.cli.main", "serve", *engine_argv(bench_engine_config(args)),
           "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
           *([] if args.engine_core_process is None else
             ["--engine-core-process" if args.engine_core_process else "--no-engine-core-process"])]
    seed = getattr(args, "seed", None) or 0
    share = getattr(args, "structured_share", 0.0) or 0.0
    prefix_len = getattr(args, "prefix_len", 0) or 0
    fd, log_path = tempfile.mkstemp(prefix="vtcore-serve-", suffix=".log")
    runs = []
    with os.fdopen(fd, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_healthy(url, proc, log_path)
            for c in concurrency:  # warmed up first (untimed): the server's histogram then holds the timed requests
                warm, timed = run_seeds(seed, c)
                run_http(url + "/v1", [c], c, input_len, 2, warm,
                         processes=client_processes(c, args.client_processes), structured_share=share,
                         schema_len=args.output_len, prefix_len=prefix_len)
                before, logged, meter = _server_totals(url), os.path.getsize(log_path), CpuMeter(proc.pid)
                doc = run_http(url + "/v1", [c], args.num_prompts, input_len, args.output_len, timed,
                               processes=client_processes(c, args.client_processes), warm_up=False,
                               structured_share=share, prefix_len=prefix_len)
                run = doc["runs"][0]
                run["server_cpu"] = meter.shares()  # (read first: the /metrics call is no part of the run)
                (ttft, tokens), ((ttft0, ttft_n0), (tokens0, steps0)) = _server_totals(url), before
                count = ttft[1] - ttft_n0
                run["server_ttft_mean_s"] = (ttft[0] - ttft0) / count if count else None
                run["server_steps"], run["server_step_tokens"] = int(tokens[1] - steps0), int(tokens[0] - tokens0)
                run["server_triton_compiles"] = _compiles_logged(log_path, logged)
                runs.append(run)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    os.unlink(log_path)
    served = {**doc, "runs": runs, "command": cmd}
    inprocess = run_bench(args, progress)
    return {"mode": "served", "served": served, "inprocess": inprocess}


def _compiles_logged(log_path: str, offset: int) -> list[str]:
    """The kernel variants the server's log says were compiled past ``offset`` (``compile_watch``'s lines:
    each ``"NAME: SPECIALISATION"``)."""
    with open(log_path, "rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    return [line.split(MARK, 1)[1] for line in text.splitlines() if MARK in line]


def format_served(doc: dict[str, Any]) -> list[str]:
    """One line per concurrency: served against in-process, and where the served TTFT goes."""
    lines = []
    inproc = {r["concurrency"]: r for r in doc["inprocess"]["runs"]}
    for s in doc["served"]["runs"]:
        i = inproc.get(s["concurrency"])
        if i is None:
            continue

        def ms(run: dict[str, Any], key: str, stat: str) -> float:
            return run[key][stat] * 1e3

        where = ""
        if s.get("server_ttft_mean_s") is not None:
            server = s["server_ttft_mean_s"] * 1e3
            where = (f"; TTFT mean {ms(s, 'ttft_s', 'mean'):.2f} ms = {ms(s, 'ttft_s', 'mean') - server:.2f} outside "
                     f"the server + {server:.2f} inside (in-process {ms(i, 'ttft_s', 'mean'):.2f})")
        lines.append(f"served / in-process, c={s['concurrency']}: output "
                     f"{s['output_throughput_tok_s'] / i['output_throughput_tok_s']:.2f}x, TTFT median "
                     f"{ms(s, 'ttft_s', 'median') - ms(i, 'ttft_s', 'median'):+.2f} ms, TPOT median "
                     f"{ms(s, 'tpot_s', 'median') - ms(i, 'tpot_s', 'median'):+.3f} ms, ITL median "
                     f"{ms(s, 'itl_s', 'median') - ms(i, 'itl_s', 'median'):+.3f} ms{where}"
                     + ("" if s.get("server_steps") is None else
                        f"; engine steps {s['server_steps']} (in-process {i['steps']})")
                     + ("" if s.get("server_triton_compiles") is None else
                        f"; Triton compiles in the server while measured: {len(s['server_triton_compiles'])}"
                        + (f" ({', '.join(sorted({c.split(':', 1)[0] for c in s['server_triton_compiles']}))})"
                           if s["server_triton_compiles"] else ""))
                     + _cpu_line(s))
    return lines


def _cpu_line(run: dict[str, Any]) -> str:
    """``; CPU cores (busiest thread): ...`` of the server's processes (the server first) and the busiest client."""
    parts = [f"{'server' if i == 0 else 'child'} {p['cores']:.2f} ({p['busiest_thread']:.2f})"
             for i, p in enumerate(run.get("server_cpu") or [])]
    if run.get("client_cpu"):
        parts.append(f"busiest of {len(run['client_cpu'])} clients {max(run['client_cpu']):.2f}")
    return f"; CPU cores (busiest thread): {', '.join(parts)}" if parts else ""
