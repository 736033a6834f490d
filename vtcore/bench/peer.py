"""``--peer hf``: HF transformers' ``generate`` on the same checkpoint, prompts, dtype and device.

Method (batch 1, greedy, ``max_new_tokens = min_new_tokens = output_len`` so every call generates
exactly ``output_len`` tokens, no EOS stop):

* the model is ``AutoModelForCausalLM.from_pretrained(model, dtype=<the engine's dtype>)`` moved to
  the engine's device, in eval mode, under ``torch.inference_mode``;
* one untimed warm-up ``generate`` runs first;
* for each prompt (the first ``k`` prompt token id lists of vtcore's concurrency-1 run), ``generate``
  is timed twice with ``time.perf_counter`` (CUDA synchronized before and after): once for
  ``output_len`` tokens (``total_s``) and once for 1 token (``first_token_s``: the prefill plus the
  first token, with the same ``generate`` overhead);
* TPOT = ``(total_s - first_token_s) / (output_len - 1)``: decode time per token, prefill excluded,
  the same definition as vtcore's TPOT (latency after the first token over the remaining tokens);
* ``output_tok_s`` = ``k * output_len / sum(total_s)`` (end-to-end, prefill included) and
  ``decode_tok_s`` = ``1 / mean TPOT``.

The peer is skipped, with the reason recorded, for ``--load-format dummy`` (vtcore's random weights
would differ from the checkpoint HF loads) and for ``output_len < 2`` (no decode step to time).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    import torch


PEER_CHOICES = ("hf",)


def skip_reason(load_format: str, output_len: int) -> str | None:
    """Why the HF peer cannot be compared in this run, or None when it can."""
    if load_format == "dummy":
        return ("--load-format dummy: vtcore runs random weights from config.json, HF would load the "
                "checkpoint's weights, so the two would not run the same model")
    if output_len < 2:
        return f"--output-len={output_len}: TPOT needs at least 2 output tokens"
    return None


def _sync(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_hf_peer(model_path: str, device: torch.device, dtype: torch.dtype, prompts: Sequence[Sequence[int]],
                output_len: int, pad_token_id: int | None = None) -> dict[str, Any]:
    """Time HF ``generate`` per prompt (see the module docstring); every number is measured here."""
    import torch

    import transformers
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
    load_s = time.perf_counter() - t0

    def generate(ids: Sequence[int], n: int) -> tuple[float, int]:
        x = torch.tensor([list(ids)], dtype=torch.long, device=device)
        _sync(device)
        start = time.perf_counter()
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                             min_new_tokens=n, pad_token_id=pad_token_id)
        _sync(device)
        return time.perf_counter() - start, int(out.shape[1] - x.shape[1])

    per_prompt = []
    try:
        with torch.inference_mode():
            generate(prompts[0], output_len)  # warm-up, untimed
            for ids in prompts:
                total_s, generated = generate(ids, output_len)
                first_s, first_generated = generate(ids, 1)
                if generated != output_len or first_generated != 1:
                    raise RuntimeError(f"HF generate produced {generated} / {first_generated} tokens, "
                                       f"expected {output_len} / 1")
                per_prompt.append({"prompt_tokens": len(ids), "output_tokens": generated, "total_s": total_s,
                                   "first_token_s": first_s,
                                   "tpot_s": (total_s - first_s) / (output_len - 1)})
    finally:
        model = None  # free it before the caller continues
        if device.type == "cuda":
            torch.cuda.empty_cache()
    tpots = [p["tpot_s"] for p in per_prompt]
    tpot = sum(tpots) / len(tpots)
    total_time = sum(p["total_s"] for p in per_prompt)
    return {"transformers_version": transformers.__version__, "load_s": load_s, "batch_size": 1,
            "num_prompts": len(per_prompt), "output_len": output_len, "tpot_s": tpot,
            "output_tok_s": sum(p["output_tokens"] for p in per_prompt) / total_time,
            "decode_tok_s": (1.0 / tpot) if tpot > 0 else None, "prompts": per_prompt}
