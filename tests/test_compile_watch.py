"""Triton compiles after an engine on a GPU started are logged, and ``vtcore bench --serve`` counts the
lines a timed run added to the server's log."""
from __future__ import annotations

import logging
from types import SimpleNamespace

from triton import knobs

from vtcore.bench.served import _compiles_logged, format_served
from vtcore.engine import compile_watch


def test_a_compile_is_logged_by_name_and_the_earlier_hook_still_runs(monkeypatch, caplog):
    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: seen.append(kw["fn"].name))
    monkeypatch.setattr(compile_watch, "_watching", False)
    compile_watch.watch_triton_compiles()
    compile_watch.watch_triton_compiles()  # once a process: a second call does not wrap the hook again
    with caplog.at_level(logging.WARNING, logger="vtcore"):
        knobs.runtime.jit_cache_hook(fn=SimpleNamespace(name="_prefill_kernel"), repr="_prefill_kernel[...](D, 1)")
    assert seen == ["_prefill_kernel"]
    assert [r.getMessage() for r in caplog.records] == [
        "Triton compiled _prefill_kernel: _prefill_kernel[...](D, 1)"]


def test_the_served_bench_counts_the_lines_past_its_offset(tmp_path):
    log = tmp_path / "serve.log"
    log.write_text("WARNING vtcore: Triton compiled _warm_kernel: x\n")
    offset = log.stat().st_size
    with log.open("a") as f:
        f.write("INFO: 127.0.0.1 POST /v1/completions 200\n"
                "WARNING vtcore: Triton compiled _prefill_kernel: _prefill_kernel[num_warps=4](D)\n"
                "WARNING vtcore: Triton compiled _decode_kernel: y\n")
    assert _compiles_logged(str(log), offset) == [
        "_prefill_kernel: _prefill_kernel[num_warps=4](D)",
        "_decode_kernel: y"]
    assert _compiles_logged(str(log), 0)[0] == "_warm_kernel: x"


def test_the_served_report_names_each_kernel_compiled_once():
    stats = {"mean": 0.01, "median": 0.01}
    run = {"concurrency": 8, "output_throughput_tok_s": 100.0, "ttft_s": stats, "tpot_s": stats, "itl_s": stats}
    served = {**run, "server_ttft_mean_s": 0.005,
              "server_triton_compiles": ["_prefill_kernel: a", "_prefill_kernel: b", "_prefill_combine_kernel: c"]}
    (line,) = format_served({"served": {"runs": [served]}, "inprocess": {"runs": [run]}})
    assert line.endswith("Triton compiles in the server while measured: 3 (_prefill_combine_kernel, _prefill_kernel)")
