"""GPU smoke check of the sync engine: HF-oracle agreement on CUDA, and a dummy-weight Qwen3-0.6B shape.

Run on a GPU machine after `pip install --no-deps --no-build-isolation -e . -e plugins/qwen3_dense`:
    python scripts/gpu_smoke.py [--out DIR]
Prints one line per check; exits non-zero on a failed oracle check. Timings here are a smoke
reading of the eager path, not benchmark numbers (those come from `vtcore bench`, issue 8).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

from vtcore import LLM, SamplingParams
from vtcore.testing.oracle import hf_model, near_tie_violations, save_checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_shapes import write_shape  # noqa: E402

TINY = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 512, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "initializer_range": 0.1}

def oracle_check(tmp: str) -> list[str]:
    failures = []
    model = hf_model(TINY)
    path = save_checkpoint(model, os.path.join(tmp, "tiny"))
    prompts = [[1], list(range(3, 10)), list(range(20, 60)), list(range(100, 117))]
    for dtype, eager in (("float32", True), ("float32", False), ("bfloat16", False)):
        llm = LLM(path, device="cuda", dtype=dtype, block_size=16, num_kv_blocks=64, enforce_eager=eager)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        for p, o in zip(prompts, outs):
            toks = o.outputs[0].token_ids
            bad = near_tie_violations(model, p, toks) if dtype == "float32" else []
            print(f"oracle cuda {dtype} {'eager' if eager else 'graphs'} prompt_len={len(p)} tokens={len(toks)} violations={len(bad)}"
                  + (f" first={bad[0]}" if bad else ""))
            if bad or len(toks) != 24:
                failures.append(f"{dtype} eager={eager} prompt_len={len(p)}")
        if not eager and llm.engine.runner.graph_replays == 0:
            failures.append(f"{dtype}: no CUDA graph was replayed")
    return failures


def dummy_06b(tmp: str) -> dict:
    """Build time, token sanity and a smoke reading of ms per token, eager and with decode graphs."""
    path = write_shape(tmp, "qwen3-0.6b")
    res = {}
    for eager in (True, False):
        t0 = time.perf_counter()
        llm = LLM(path, device="cuda", load_format="dummy", max_model_len=2048, max_num_seqs=16,
                  enforce_eager=eager)
        build = time.perf_counter() - t0
        params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        a = llm.generate({"prompt_token_ids": list(range(1000, 1100))}, params)[0].outputs[0].token_ids
        b = llm.generate({"prompt_token_ids": list(range(5000, 5100))}, params)[0].outputs[0].token_ids
        times = {}
        for n in (2, 129):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            llm.generate({"prompt_token_ids": list(range(1000, 1100))},
                         SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            torch.cuda.synchronize()
            times[n] = time.perf_counter() - t0
        res["eager" if eager else "graphs"] = {
            "build_s": round(build, 2), "distinct_tokens_a": len(set(a)), "outputs_differ": a != b,
            "ms_per_decode_token": round((times[129] - times[2]) / 127 * 1e3, 3),
            "graph_replays": llm.engine.runner.graph_replays, "kv_blocks": llm.engine.runner.num_kv_blocks}
        print(f"dummy qwen3-0.6B shape bf16 {'eager' if eager else 'graphs'}:", res["eager" if eager else "graphs"])
        del llm
        torch.cuda.empty_cache()
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__)
    with tempfile.TemporaryDirectory() as tmp:
        failures = oracle_check(tmp)
        res = dummy_06b(tmp)
    if args.out:
        with open(os.path.join(args.out, "gpu_smoke.json"), "w") as f:
            json.dump({"failures": failures, "dummy_06b": res}, f, indent=2)
    print("FAILED: " + ", ".join(failures) if failures else "all oracle checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
