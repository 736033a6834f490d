"""``--peer hf``: HF transformers' ``generate`` on the same model, prompts, dtype and device, in the same run.

The model (loaded once, after vtcore's engine is freed):

* ``--load-format auto``: ``AutoModelForCausalLM.from_pretrained(model, dtype=<the engine's dtype>)``
  moved to the engine's device; ``weights`` is ``"checkpoint"``.
* ``--load-format dummy`` (a folder may hold only config.json): ``AutoModelForCausalLM.from_config(
  AutoConfig.from_pretrained(model), dtype=...)`` built under ``torch.device(<device>)``, so the
  parameters are allocated and randomly initialized directly on the device (no slow CPU init of a
  multi-GB model, no copy); ``weights`` is ``"random (from config), same shape as vtcore's dummy
  weights"``. The timings stay comparable with vtcore's dummy-weight run: both models have the same
  architecture, parameter shapes and dtype, every ``generate`` is forced to exactly ``output_len``
  tokens (``min_new_tokens = max_new_tokens``, greedy, so EOS never ends a sequence early), and the
  prompts are the same token ids; the weight values change which tokens come out, not the work
  (the same GEMMs, attention over the same context lengths, the same KV cache sizes).

Both in eval mode, under ``torch.inference_mode``, timed with ``time.perf_counter`` with CUDA
synchronized before and after each ``generate``.

Batch 1 (``hf``): untimed warm-up ``generate`` calls of both lengths; for each prompt (the first ``k`` prompts of
vtcore's concurrency-1 run) ``generate`` is timed for ``output_len`` tokens (``total_s``) and for 1
token (``first_token_s``: prefill plus first token, same ``generate`` overhead); TPOT =
``(total_s - first_token_s) / (output_len - 1)``, vtcore's definition (latency after the first token
over the remaining tokens); ``output_tok_s = k * output_len / sum(total_s)``, ``decode_tok_s = 1 / TPOT``.

Batched (``batched``, only when the largest concurrency ``C`` of the grid is > 1): the first ``C``
prompts of vtcore's concurrency-``C`` run in one ``generate`` of batch size ``C`` (left-padded with
an attention mask when the lengths differ; the serving run's prompts are of equal length, so no
padding), after one untimed warm-up ``generate`` of the same batch for ``WARMUP_TOKENS`` tokens;
``output_tok_s = C * output_len / time_s`` and ``throughput_ratio`` = vtcore's output throughput at
concurrency ``C`` / ``output_tok_s``.

The peer is skipped, with the reason recorded, for ``output_len < 2`` (no decode step to time).
"""
from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    import torch

    from vtcore.config import EngineConfig


PEER_CHOICES = ("hf",)
PEER_PROMPTS = 4
WARMUP_TOKENS = 2
RANDOM_WEIGHTS = "random (from config), same shape as vtcore's dummy weights"
CHECKPOINT_WEIGHTS = "checkpoint"


def skip_reason(output_len: int) -> str | None:
    """Why the HF peer cannot be compared in this run, or None when it can."""
    if output_len < 2:
        return f"--output-len={output_len}: TPOT needs at least 2 output tokens"
    return None


def _sync(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def load_hf_model(model_path: str, device: torch.device, dtype: torch.dtype, load_format: str,
                  seed: int = 0) -> tuple[Any, str, float]:
    """(model in eval mode on ``device``, ``weights`` label, load seconds); see the module docstring."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    t0 = time.perf_counter()
    if load_format == "dummy":
        torch.manual_seed(seed)
        config = AutoConfig.from_pretrained(model_path)
        with torch.device(device):  # allocate and random-init on the device itself
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        weights = RANDOM_WEIGHTS
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device)
        weights = CHECKPOINT_WEIGHTS
    model = model.eval()
    _sync(device)
    return model, weights, time.perf_counter() - t0


def batch_inputs(prompts: Sequence[Sequence[int]], pad_token_id: int | None,
                 device: Any = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of shape [len(prompts), longest], left-padded (mask 0 on the padding)."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), 0 if pad_token_id is None else pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


def timed_generate(model: Any, device: torch.device, prompts: Sequence[Sequence[int]], n: int,
                   pad_token_id: int | None) -> tuple[float, int]:
    """(seconds, new tokens per row) of one greedy ``generate`` forced to exactly ``n`` new tokens."""
    ids, mask = batch_inputs(prompts, pad_token_id, device)
    _sync(device)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                         pad_token_id=pad_token_id)
    _sync(device)
    return time.perf_counter() - start, int(out.shape[1] - ids.shape[1])


def run_batch1(model: Any, device: torch.device, prompts: Sequence[Sequence[int]], output_len: int,
               pad_token_id: int | None) -> dict[str, Any]:
    """Batch-1 TPOT and throughput over ``prompts`` (see the module docstring)."""
    for n in (output_len, 1):  # warm-up of both timed lengths, untimed: the first 1-token call pays lazy setup
        timed_generate(model, device, [prompts[0]], n, pad_token_id)
    per_prompt = []
    for ids in prompts:
        total_s, generated = timed_generate(model, device, [ids], output_len, pad_token_id)
        first_s, first_generated = timed_generate(model, device, [ids], 1, pad_token_id)
        if generated != output_len or first_generated != 1:
            raise RuntimeError(f"HF generate produced {generated} / {first_generated} tokens, "
                               f"expected {output_len} / 1")
        per_prompt.append({"prompt_tokens": len(ids), "output_tokens": generated, "total_s": total_s,
                           "first_token_s": first_s, "tpot_s": (total_s - first_s) / (output_len - 1)})
    tpot = sum(p["tpot_s"] for p in per_prompt) / len(per_prompt)
    return {"batch_size": 1, "num_prompts": len(per_prompt), "output_len": output_len, "tpot_s": tpot,
            "output_tok_s": sum(p["output_tokens"] for p in per_prompt) / sum(p["total_s"] for p in per_prompt),
            "decode_tok_s": (1.0 / tpot) if tpot > 0 else None, "prompts": per_prompt}


def run_batched(model: Any, device: torch.device, prompts: Sequence[Sequence[int]], output_len: int,
                pad_token_id: int | None, vtcore_output_tok_s: float | None = None) -> dict[str, Any]:
    """One warm-up, then one timed ``generate`` of every prompt as one batch (see the module docstring)."""
    c = len(prompts)
    timed_generate(model, device, prompts, min(WARMUP_TOKENS, output_len), pad_token_id)  # warm-up, untimed
    time_s, generated = timed_generate(model, device, prompts, output_len, pad_token_id)
    if generated != output_len:
        raise RuntimeError(f"HF batched generate produced {generated} tokens per row, expected {output_len}")
    lengths = [len(p) for p in prompts]
    tok_s = c * output_len / time_s
    return {"skipped": False, "skip_reason": None, "batch_size": c, "num_prompts": c,
            "prompt_tokens": sum(lengths), "left_padded": len(set(lengths)) > 1, "output_len": output_len,
            "output_tokens": c * output_len, "warmup_new_tokens": min(WARMUP_TOKENS, output_len),
            "time_s": time_s, "output_tok_s": tok_s, "vtcore_output_tok_s": vtcore_output_tok_s,
            "throughput_ratio": (vtcore_output_tok_s / tok_s) if vtcore_output_tok_s is not None else None}


def run_hf_peer(model_path: str, device: torch.device, dtype: torch.dtype, prompts: Sequence[Sequence[int]],
                output_len: int, pad_token_id: int | None = None, load_format: str = "auto", seed: int = 0,
                batched_prompts: Sequence[Sequence[int]] | None = None,
                vtcore_batched_tok_s: float | None = None) -> dict[str, Any]:
    """Load HF's model once; the batch-1 numbers, plus ``batched`` when ``batched_prompts`` are given."""
    import torch
    import transformers

    model, weights, load_s = load_hf_model(model_path, device, dtype, load_format, seed)
    try:
        with torch.inference_mode():
            doc = run_batch1(model, device, prompts, output_len, pad_token_id)
            batched = (run_batched(model, device, batched_prompts, output_len, pad_token_id, vtcore_batched_tok_s)
                       if batched_prompts else None)
    finally:
        model = None  # free it before the caller continues
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"transformers_version": transformers.__version__, "weights": weights, "load_s": load_s, **doc,
            "batched": batched}


def peer_section(peer: str, config: EngineConfig, device: Any, dtype: Any, args: Any, runs: list[dict[str, Any]],
                 prompts_by_c: dict[int, list[list[int]]], input_len: int, vocab_size: int, rng: random.Random,
                 pad: int | None) -> dict[str, Any]:
    """The ``peer`` document: HF at batch 1 (TPOT ratio against vtcore at concurrency 1) and batched at
    the largest concurrency (output throughput ratio); ``config`` is vtcore's engine's, its model the
    checkpoint folder."""
    section: dict[str, Any] = {"name": peer, "skipped": False, "skip_reason": None}
    reason = skip_reason(args.output_len)
    if reason:
        return {**section, "skipped": True, "skip_reason": reason}
    c1 = next((r for r in runs if r["concurrency"] == 1), None)
    if c1 is not None:
        k = min(c1["num_prompts"], PEER_PROMPTS)
        prompts = prompts_by_c[1][:k]
        tpots = [r["tpot_s"] for r in c1["requests"][:k]]
        vtcore_tpot = sum(tpots) / len(tpots)
        ratio_note = None
    else:  # no concurrency-1 run to compare with: HF still measured, on fresh prompts, no ratio
        k = min(args.num_prompts or PEER_PROMPTS, PEER_PROMPTS)
        prompts = [[rng.randrange(vocab_size) for _ in range(input_len)] for _ in range(k)]
        vtcore_tpot = None
        ratio_note = "no concurrency-1 run in --concurrency: no vtcore TPOT to compare"
    top = max(runs, key=lambda r: r["concurrency"])
    big = top["concurrency"]
    hf_doc = run_hf_peer(config.model, device, dtype, prompts, args.output_len, pad_token_id=pad,
                         load_format=config.load_format, seed=config.seed,
                         batched_prompts=prompts_by_c[big][:big] if big > 1 else None,
                         vtcore_batched_tok_s=top["output_throughput_tok_s"])
    batched = hf_doc.pop("batched") or {
        "skipped": True, "skip_reason": "the largest concurrency is 1: no batch to compare"}
    batched["concurrency"] = big
    hf_tpot = hf_doc["tpot_s"]
    return {**section, "hf": hf_doc, "num_prompts": k, "same_prompts_as_concurrency_1": c1 is not None,
            "vtcore_tpot_s": vtcore_tpot, "hf_tpot_s": hf_tpot,
            "tpot_ratio": (vtcore_tpot / hf_tpot) if vtcore_tpot is not None and hf_tpot > 0 else None,
            "tpot_ratio_note": ratio_note, "batched": batched}


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def format_peer(peer: dict[str, Any], ms: Any) -> list[str]:
    """The printed peer lines (``ms`` formats seconds as milliseconds)."""
    if peer["skipped"]:
        return [f"peer {peer['name']}: skipped: {peer['skip_reason']}"]
    h, ratio, b = peer["hf"], peer["tpot_ratio"], peer["batched"]
    lines = [f"peer {peer['name']} (transformers {h['transformers_version']}, weights: {h['weights']}; batch 1, "
             f"{peer['num_prompts']} prompts): TPOT {ms(peer['hf_tpot_s'])} ms, {h['output_tok_s']:.1f} out tok/s, "
             f"decode {h['decode_tok_s'] or 0:.1f} tok/s; vtcore c=1 TPOT {ms(peer['vtcore_tpot_s'])} ms; "
             f"vtcore/HF TPOT {'-' if ratio is None else f'{ratio:.2f}'}"
             f"{'' if peer['tpot_ratio_note'] is None else ' (' + peer['tpot_ratio_note'] + ')'}"]
    if b["skipped"]:
        lines.append(f"peer {peer['name']} batched: skipped: {b['skip_reason']}")
    else:
        lines.append(f"peer {peer['name']} batched (batch {b['batch_size']}, the first {b['num_prompts']} prompts of "
                     f"c={b['concurrency']}{', left-padded' if b['left_padded'] else ''}): {b['output_len']} tokens "
                     f"each in {b['time_s']:.3f} s, {b['output_tok_s']:.1f} out tok/s; vtcore c={b['concurrency']} "
                     f"{_fmt(b['vtcore_output_tok_s'], '.1f')} out tok/s; vtcore/HF output throughput "
                     f"{_fmt(b['throughput_ratio'], '.2f')}x")
    return lines
