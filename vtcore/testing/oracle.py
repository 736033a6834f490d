"""HF transformers as the oracle: tiny random checkpoints and the near-tie rule for greedy tokens.

The near-tie rule: run the HF model teacher-forced on prompt + our generated tokens; at every
position our token must be HF's argmax, or within ``tol`` of HF's top logit (CPU float32
matmul is not batch-invariant, so a near-tie may legitimately flip). Any other difference fails.
"""
from __future__ import annotations

import json
import os
import random
from typing import Any

import torch

from vtcore.testing.parameters import redraw_constants

#: A tiny Qwen3 config (2 layers, GQA 2) for tests: small enough for CPU float32 in milliseconds.
TINY_QWEN3: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 512,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "tie_word_embeddings": False, "initializer_range": 0.1,
}


def tiny_config(**overrides: Any) -> dict[str, Any]:
    """``TINY_QWEN3`` with ``overrides`` applied."""
    return {**TINY_QWEN3, **overrides}


def hf_model(hf_config: dict[str, Any], seed: int = 0, oracle: str | None = None, nontrivial: bool = True
             ) -> torch.nn.Module:
    """A float32 random-initialised transformers model of ``hf_config``.

    ``nontrivial``: every tensor transformers initialises to a constant (norm weights, biases,
    ``dt_bias``) is redrawn around it (:func:`vtcore.testing.parameters.redraw_constants`), so that a
    family ignoring one of them disagrees with the oracle; the constants are kept on the model as
    ``vtcore_init_constants`` (name -> value), for resetting them again.

    The class is ``oracle`` (a lazy ``"module:Class"``) or else transformers' ``architectures[0]``;
    the saved config keeps ``hf_config``'s architectures, so a family may serve the oracle's math
    under an architecture name of its own.
    """
    import transformers

    from vtcore.family import resolve_ref

    config = transformers.AutoConfig.for_model(**{k: v for k, v in hf_config.items() if k != "architectures"})
    config.architectures = list(hf_config["architectures"])
    cls = resolve_ref(oracle) if oracle else getattr(transformers, hf_config["architectures"][0])
    torch.manual_seed(seed)
    model = cls(config).float().eval()
    model.vtcore_init_constants = redraw_constants(model, seed) if nontrivial else {}
    return model


def save_checkpoint(model: torch.nn.Module, path: str) -> str:
    """Save as an HF folder (config.json + model.safetensors) and return the path.

    The saved config keeps the model config's ``architectures`` (transformers would write the
    class name), so an oracle class can stand in for a family of another name.
    """
    from transformers.utils import logging as hf_logging

    os.makedirs(path, exist_ok=True)
    hf_logging.disable_progress_bar()
    architectures = list(model.config.architectures or [type(model).__name__])
    model.save_pretrained(path, safe_serialization=True)
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["architectures"] = architectures
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)
    return path


@torch.no_grad()
def teacher_forced_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] float32 logits of the HF model on one sequence (on the model's device)."""
    return model(torch.tensor([ids], device=next(model.parameters()).device)).logits[0].float()


def near_tie_violations(model: torch.nn.Module, prompt: list[int], generated: list[int],
                        tol: float = 1e-4) -> list[tuple[int, int, int, float]]:
    """Positions where our greedy token is neither HF's argmax nor within ``tol`` of its top logit.

    Returns (position, our token, HF's token, logit gap) for each violation; empty means correct.
    """
    if not generated:
        return []
    logits = teacher_forced_logits(model, prompt + generated[:-1])[len(prompt) - 1:]
    bad = []
    for i, tok in enumerate(generated):
        top = int(logits[i].argmax())
        gap = float(logits[i, top] - logits[i, tok])
        if tok != top and gap > tol:
            bad.append((i, tok, top, gap))
    return bad


def random_prompt(n: int, seed: int, vocab: int = 512) -> list[int]:
    """``n`` token ids drawn uniformly from the vocabulary with a fixed seed."""
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]
