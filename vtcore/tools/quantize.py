"""``vtcore quantize``: an HF checkpoint to a compressed-tensors FP4 checkpoint (NVFP4 / MXFP4, A16 or W4A4).

This is the one place vtcore uses the ``compressed-tensors`` library (imported lazily, inside the
functions), so the written checkpoint is exactly what compressed-tensors itself would write:

- every ``nn.Linear`` of the transformers model except ``lm_head``, the modules the checkpoint's model
  family says a quantizer must leave alone (``ModelFamily.quant_ignore``: routers, gates, vision
  towers) and any ``--ignore`` pattern gets compressed-tensors' preset scheme via ``apply_quantization_config``
  (targets ``["Linear"]``), its qparams computed with compressed-tensors' ``generate_gparam`` /
  ``calculate_qparams`` (min-max, as llm-compressor's default observers), and is compressed by
  ``compress_module`` into ``weight_packed`` (uint8 [out, in/2]), ``weight_scale`` and, for NVFP4,
  ``weight_global_scale`` (float32 [1]). Linears whose in_features is not a multiple of the group
  size stay dense and are listed in ``ignore``.
- NVFP4: projections the family's model fuses (its ``packed_modules_mapping``: q/k/v, gate/up, ...,
  and each expert's gate/up) share one ``weight_global_scale`` (the minimum), as llm-compressor does
  for vLLM.
- fused 3-D MoE experts (transformers' ``experts.gate_up_proj`` [E, 2I, H] / ``experts.down_proj``
  [E, H, I]), which are not ``nn.Linear``, are split per expert and compressed one expert at a time
  with the format's compressor, written as ``<experts>.<e>.gate_proj|up_proj|down_proj.<param>``:
  the names llm-compressor's unfused expert Linears get, covered by the ``"Linear"`` target.
- W4A4: NVFP4 has a static per-Linear ``input_global_scale`` (float32 [1]; its per-16 local scales
  are dynamic), calibrated here (static min-max) on a short built-in English text; experts are
  calibrated on every token of the layer (llm-compressor's ``calibrate_all_experts``). MXFP4's
  activation scales are fully dynamic: nothing is calibrated or stored.
- every tensor of SRC that is not a quantized weight (norms, embeddings, lm_head, routers, conv,
  MTP or vision weights transformers did not load, ...) is copied byte for byte (tensors under a
  top-level prefix the model lacks, e.g. ``mtp.``, are ignored as ``re:^mtp\\..*``); the config is SRC's
  config.json plus the ``quantization_config`` compressed-tensors' ``ModelCompressor`` writes; the
  tokenizer and the other non-weight files are copied.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TextIO

from vtcore.errors import CheckpointError, NotSupportedError

if TYPE_CHECKING:
    import torch
    from torch import nn

log = logging.getLogger(__name__)

SCHEMES: tuple[str, ...] = ("NVFP4A16", "MXFP4A16", "NVFP4", "MXFP4")
FORMATS: dict[str, str] = {"NVFP4A16": "nvfp4-pack-quantized", "NVFP4": "nvfp4-pack-quantized",
                           "MXFP4A16": "mxfp4-pack-quantized", "MXFP4": "mxfp4-pack-quantized"}
DEFAULT_IGNORE: tuple[str, ...] = ("lm_head",)

#: Calibration text for the static activation scales of W4A4 NVFP4 (a few varied English sentences).
CALIBRATION_TEXT = (
    "The quick brown fox jumps over the lazy dog while the farmer watches from the porch. "
    "In 1969, two astronauts walked on the Moon and collected 21.5 kilograms of rock and dust. "
    "Photosynthesis turns sunlight, water and carbon dioxide into sugar and oxygen inside the leaves. "
    "She asked him, \"Could you please send me the report by Friday afternoon?\" and he agreed. "
    "A good recipe for bread needs only flour, water, salt, yeast, patience and a hot oven. "
    "The committee reviewed 42 proposals, rejected most of them, and funded three research projects. "
    "def add(a, b):\n    return a + b  # a tiny Python function that adds two numbers\n"
    "Rivers carve valleys over millions of years, and the mountains slowly wear away into sand. "
    "When the market opened on Monday, prices rose sharply before falling back in the afternoon. "
    "Learning a new language takes practice: read every day, listen carefully and speak without fear."
)
MAX_CALIBRATION_TOKENS = 256

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")
_SHARD_BYTES = 4 * 1024**3


def normalize_scheme(scheme: str) -> str:
    """``scheme`` as its preset name (case-insensitive), or ValueError naming the value and the choices."""
    name = str(scheme).strip().upper()
    if name not in SCHEMES:
        raise ValueError(f"quantization scheme {scheme!r} is not supported; expected one of {', '.join(SCHEMES)}")
    return name


# --------------------------------------------------------------------------------------------- entry point


def quantize_checkpoint(src: str, dst: str, scheme: str, *, ignore: Iterable[str] | None = None,
                        calibration_text: str | None = None, show_progress: bool = True) -> None:
    """Quantize the HF checkpoint folder ``src`` with ``scheme`` and write a compressed-tensors checkpoint to ``dst``.

    ``scheme`` is one of NVFP4A16, MXFP4A16, NVFP4, MXFP4. ``ignore`` adds module names or ``re:``
    regexes (compressed-tensors syntax, matched against transformers module names) to ``lm_head``.
    ``dst`` must not exist or be empty.
    """
    import torch
    from torch import nn

    scheme = normalize_scheme(scheme)
    for pattern in ignore or ():
        if pattern.startswith("re:"):
            try:
                re.compile(pattern[3:])
            except re.error as exc:
                raise ValueError(f"ignore pattern {pattern!r}: not a valid regular expression ({exc})") from None
    src, dst = os.path.abspath(src), os.path.abspath(dst)
    src_config = _read_src_config(src)
    if os.path.exists(dst) and (not os.path.isdir(dst) or os.listdir(dst)):
        raise FileExistsError(f"quantize destination {dst!r} exists and is not an empty folder")
    src_files = _safetensors_index(src)

    try:
        import compressed_tensors  # noqa: F401 - the packed-format library quantize writes with
    except ImportError:
        raise NotSupportedError("vtcore quantize writes checkpoints with the compressed-tensors library, which is "
                                "not installed: pip install compressed-tensors==0.20.1") from None
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.base import compress_module
    from compressed_tensors.compressors.model_compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationConfig, QuantizationStatus,
                                                 apply_quantization_config, preset_name_to_scheme)
    from compressed_tensors.utils.match import match_name, match_named_modules
    from tqdm.auto import tqdm

    qscheme = preset_name_to_scheme(scheme, ["Linear"])
    wargs = qscheme.weights
    group = wargs.group_size
    nv = wargs.strategy == "tensor_group"
    static_input = qscheme.input_activations is not None and qscheme.input_activations.dynamic is not True
    compressor = BaseCompressor.get_value_from_registry(FORMATS[scheme])

    family = _family(src_config)
    model = _load_model(src, src_config)
    ignore_list = _dedupe(list(DEFAULT_IGNORE) + list(ignore or ()))
    names = [n for n, _ in model.named_modules()]
    ignore_list += [p for p in family.quant_ignore if any(match_name(n, p) for n in names)]
    fused_groups = _fused_groups(family)

    # Linears to quantize; those whose in_features the group size does not divide stay dense.
    linears: dict[str, nn.Linear] = {}
    for name, module in match_named_modules(model, ["Linear"], ignore_list):
        if not isinstance(module, nn.Linear):
            continue
        if module.in_features % group:
            log.warning("%s: in_features=%d is not a multiple of the %s group size %d; left unquantized",
                        name, module.in_features, scheme, group)
            ignore_list.append(name)
            continue
        linears[name] = module

    # Fused 3-D experts (not nn.Linear): quantized per expert unless ignored or not divisible.
    experts: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        layout = _experts_layout(module)
        if layout is None:
            continue
        num, inter, hidden = layout
        per_expert = [f"{name}.{e}.{p}" for e in range(num) for p in ("gate_proj", "up_proj", "down_proj")]
        if any(match_name(n, pat) for n in per_expert for pat in ignore_list):
            log.warning("%s: matched by ignore; its experts stay dense", name)
        elif hidden % group or inter % group:
            log.warning("%s: hidden=%d / intermediate=%d not multiples of the %s group size %d; experts stay dense",
                        name, hidden, inter, scheme, group)
        else:
            experts[name] = module
            continue
        ignore_list.append(name)

    if not linears and not experts:
        raise CheckpointError(f"{src}: no Linear layer to quantize with {scheme} (ignore={ignore_list})")

    input_amax: dict[str, torch.Tensor] = {}
    if static_input:
        input_amax = _calibrate(model, src, src_config, linears, experts, calibration_text or CALIBRATION_TEXT)

    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": qscheme}, ignore=ignore_list),
                              show_progress=False)
    quantized = {name: m for name, m in model.named_modules() if getattr(m, "quantization_scheme", None)}
    if set(quantized) != set(linears):
        raise RuntimeError(f"compressed-tensors targeted {sorted(set(quantized) ^ set(linears))} unexpectedly")

    from compressed_tensors.quantization.utils import generate_gparam

    # NVFP4 global scales: per Linear, then the minimum over each fused sibling group.
    global_scale: dict[str, torch.Tensor] = {}
    if nv:
        for name, module in linears.items():
            w = module.weight.detach().float()
            global_scale[name] = generate_gparam(w.amin(), w.amax())
        for name, module in model.named_modules():
            for group in fused_groups:
                full = [f"{name}.{c}" if name else c for c in group]
                if all(f in global_scale for f in full):
                    shared = torch.min(torch.cat([global_scale[f] for f in full])).reshape(1)
                    for f in full:
                        global_scale[f] = shared.clone()

    products: dict[str, torch.Tensor] = {}  # model-named tensors to write
    bar = tqdm(total=len(linears) + len(experts), desc=f"Quantizing {scheme}", unit="module",
               disable=not show_progress)
    with torch.no_grad():
        for name, module in linears.items():
            w = module.weight.detach().float()
            gs = global_scale.get(name)
            module.weight_scale.data.copy_(_group_scales(w, wargs, gs).to(module.weight_scale.dtype))
            if nv:
                module.weight_global_scale.data.copy_(gs)
            if static_input:
                module.input_global_scale.data.copy_(_input_global_scale(name, input_amax.get(name)))
            module.quantization_status = QuantizationStatus.FROZEN
            compress_module(module)
            bar.update(1)
        for name, module in experts.items():
            products.update(_compress_experts(name, module, qscheme, compressor, nv, static_input, input_amax))
            bar.update(1)
    bar.close()

    for name, module in linears.items():  # the bias, if any, is copied from SRC with the other tensors
        for pname, tensor in module.named_parameters(recurse=False):
            if pname != "bias":
                products[f"{name}.{pname}"] = tensor.detach()

    qcompressor = ModelCompressor.from_pretrained_model(model)
    qconfig = qcompressor.quantization_config
    qconfig.quantization_status = QuantizationStatus.COMPRESSED
    # compressed-tensors lists the unquantized Linears by (checkpoint) name; add dense experts and the
    # user's patterns
    rename = _checkpoint_renamer(model)
    extra = [p if p.startswith("re:") else rename(f"{p}.weight").removesuffix(".weight") for p in ignore_list]
    qconfig.ignore = _dedupe(list(qconfig.ignore or []) + extra)

    unloaded = _write_checkpoint(model, src, dst, src_config, src_files, products, linears, experts)
    # SRC tensors outside every module of the model (e.g. MTP layers transformers does not load) are
    # copied dense; like compressed-tensors' save_mtp_tensors_to_checkpoint, ignore them by prefix.
    qconfig.ignore = _dedupe(list(qconfig.ignore) + [f"re:^{re.escape(p)}\\..*" for p in unloaded])
    qcompressor.update_config(dst)
    log.info("wrote %s (%s): %d Linear layers and %d expert blocks quantized", dst, scheme, len(linears), len(experts))


# ------------------------------------------------------------------------------------------------- helpers


def _family(src_config: dict[str, Any]) -> Any:
    """The registered model family of the checkpoint (its quant_ignore and fused projections)."""
    from vtcore.config import HFConfig
    from vtcore.plugins.manager import get_plugins

    return get_plugins().family_for(HFConfig(src_config).architecture)


def _fused_groups(family: Any) -> list[tuple[str, ...]]:
    """Sibling projections the family's model fuses into one matmul (``packed_modules_mapping``
    grouped by fused name, in shard order); under NVFP4 they share a global scale."""
    groups: dict[str, list[str]] = {}
    for part, (fused, _) in getattr(family.load_class(), "packed_modules_mapping", {}).items():
        groups.setdefault(fused, []).append(part)
    return [tuple(g) for g in groups.values() if len(g) > 1]


def _read_src_config(src: str) -> dict[str, Any]:
    if not os.path.isdir(src):
        raise FileNotFoundError(f"quantize source {src!r} is not a folder (expected an HF checkpoint folder)")
    path = os.path.join(src, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"quantize source {src!r} has no config.json (expected an HF checkpoint folder)")
    try:
        with open(path) as f:
            config = json.load(f)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    existing = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if existing:
        raise CheckpointError(f"{src}: already quantized (quantization_config "
                              f"{existing.get('quant_method', existing.get('format', '?'))!r}); quantize an "
                              "unquantized checkpoint")
    return config


def _safetensors_index(src: str) -> dict[str, str]:
    """Tensor name -> file name of every ``*.safetensors`` in ``src``."""
    from safetensors import safe_open

    files = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{src}: no *.safetensors weights (quantize reads safetensors checkpoints)")
    from safetensors import SafetensorError

    index: dict[str, str] = {}
    for fname in files:
        try:
            with safe_open(os.path.join(src, fname), framework="pt") as f:
                for key in f.keys():
                    index[key] = fname
        except SafetensorError as exc:
            raise CheckpointError(f"{os.path.join(src, fname)}: truncated or corrupt safetensors file "
                                  f"({exc})") from None
    return index


def _load_model(src: str, config: dict[str, Any]) -> nn.Module:
    import transformers
    from transformers.utils import logging as hf_logging

    archs = config.get("architectures") or []
    cls = getattr(transformers, archs[0], None) if archs else None
    if cls is None or not hasattr(cls, "from_pretrained"):
        cls = transformers.AutoModelForCausalLM  # an architecture name of vtcore's own: by model_type
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model = cls.from_pretrained(src, dtype="auto")
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return model.eval()


def _dedupe(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))


def _experts_layout(module: nn.Module) -> tuple[int, int, int] | None:
    """(num_experts, intermediate, hidden) for a transformers fused-experts module, else None."""
    gate_up = module._parameters.get("gate_up_proj")
    down = module._parameters.get("down_proj")
    if gate_up is None or down is None or gate_up.ndim != 3 or down.ndim != 3:
        return None
    if getattr(module, "has_bias", False) or getattr(module, "has_gate", True) is False:
        raise NotImplementedError(f"{type(module).__name__}: fused experts with biases or without a gate are "
                                  "not supported by vtcore quantize")
    num = gate_up.shape[0]
    if getattr(module, "is_transposed", False):
        hidden, inter2 = gate_up.shape[1:]
    else:
        inter2, hidden = gate_up.shape[1:]
    return num, inter2 // 2, hidden


def _expert_weights(module: nn.Module, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gate [I, H], up [I, H], down [H, I]) of expert ``e``, as nn.Linear weights."""
    gate_up, down = module.gate_up_proj[e], module.down_proj[e]
    if getattr(module, "is_transposed", False):
        gate_up, down = gate_up.t(), down.t()
    if getattr(module, "is_concatenated", True):
        gate, up = gate_up.chunk(2, dim=0)
    else:
        gate, up = gate_up[0::2], gate_up[1::2]
    return gate.contiguous(), up.contiguous(), down.contiguous()


def _group_scales(w: torch.Tensor, args: Any, global_scale: torch.Tensor | None) -> torch.Tensor:
    """Min-max group scales of a 2-D weight, as compressed-tensors computes them (fp8- or e8m0-valued floats)."""
    from compressed_tensors.quantization.utils import calculate_qparams

    g = args.group_size
    grouped = w.float().unflatten(-1, (w.shape[-1] // g, g))
    scale, _ = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args, global_scale=global_scale)
    return scale


def _input_global_scale(name: str, amax: torch.Tensor | None) -> torch.Tensor:
    import torch

    from compressed_tensors.quantization.utils import generate_gparam

    if amax is None:
        log.warning("%s: saw no calibration input; input_global_scale = 1.0", name)
        return torch.ones(1, dtype=torch.float32)
    return generate_gparam(-amax, amax)


def _compress_experts(name: str, module: nn.Module, scheme: Any, compressor: Any, nv: bool, static_input: bool,
                      input_amax: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert compressed tensors ``{name}.{e}.{gate,up,down}_proj.{param}`` of a fused-experts module."""
    import torch

    from compressed_tensors.quantization.utils import generate_gparam

    out: dict[str, torch.Tensor] = {}
    num = module.gate_up_proj.shape[0]
    for e in range(num):
        gate, up, down = _expert_weights(module, e)
        gate_up_gs = down_gs = None
        if nv:  # gate and up share one global scale (one fused w13 tensor in serving engines)
            gu = torch.cat([gate, up]).float()
            gate_up_gs = generate_gparam(gu.amin(), gu.amax())
            down_gs = generate_gparam(down.float().amin(), down.float().amax())
        for proj, w, gs in (("gate_proj", gate, gate_up_gs), ("up_proj", up, gate_up_gs), ("down_proj", down, down_gs)):
            state = {"weight": w, "weight_scale": _group_scales(w, scheme.weights, gs)}
            if nv:
                state["weight_global_scale"] = gs.clone()
            prefix = f"{name}.{e}.{proj}"
            if static_input:
                key = f"{name}.gate_up" if proj != "down_proj" else f"{name}.{e}.down"
                state["input_global_scale"] = _input_global_scale(prefix, input_amax.get(key))
            for key, tensor in compressor.compress(state, scheme).items():
                out[f"{prefix}.{key}"] = tensor.detach().contiguous()
    return out


# ----------------------------------------------------------------------------------------------- calibration


def _calibration_ids(src: str, config: dict[str, Any], text: str) -> list[int]:
    """Token ids of ``text`` with SRC's tokenizer; without one, bytes modulo the vocabulary."""
    has_tokenizer = any(os.path.exists(os.path.join(src, f)) for f in
                        ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json"))
    if has_tokenizer:
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(src)(text)["input_ids"]
    else:
        vocab = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
        log.warning("%s has no tokenizer; calibrating on the text's bytes modulo vocab_size=%s", src, vocab)
        ids = [b % int(vocab) for b in text.encode("utf-8")]
    return ids[:MAX_CALIBRATION_TOKENS]


def _calibrate(model: nn.Module, src: str, config: dict[str, Any], linears: dict[str, nn.Linear],
               experts: dict[str, nn.Module], text: str) -> dict[str, torch.Tensor]:
    """Static min-max: the largest |input| each targeted Linear and expert projection sees on ``text``."""
    import torch

    amax: dict[str, torch.Tensor] = {}

    def observe(key: str, x: torch.Tensor) -> None:
        m = x.detach().abs().amax().float().reshape(1).cpu()
        amax[key] = torch.maximum(amax[key], m) if key in amax else m

    def linear_hook(name: str) -> Callable:
        return lambda mod, args: observe(name, args[0])

    def experts_hook(name: str) -> Callable:
        def hook(mod: nn.Module, args: tuple, kwargs: dict) -> None:
            x = args[0] if args else kwargs["hidden_states"]
            x = x.reshape(-1, x.shape[-1])
            observe(f"{name}.gate_up", x)  # every expert sees every token (calibrate_all_experts)
            for e in range(mod.gate_up_proj.shape[0]):
                gate, up, _ = _expert_weights(mod, e)
                h = mod.act_fn(x @ gate.t().to(x.dtype)) * (x @ up.t().to(x.dtype))
                observe(f"{name}.{e}.down", h)
        return hook

    handles = [m.register_forward_pre_hook(linear_hook(n)) for n, m in linears.items()]
    handles += [m.register_forward_pre_hook(experts_hook(n), with_kwargs=True) for n, m in experts.items()]
    ids = _calibration_ids(src, config, text)
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return amax


# ------------------------------------------------------------------------------------------------- writing


def _checkpoint_renamer(model: nn.Module) -> Callable[[str], str]:
    """Model tensor name -> SRC checkpoint name (transformers' load-time renamings, reversed)."""
    conversions = getattr(model, "_weight_conversions", None) or []
    if not conversions:
        return lambda key: key
    from transformers.core_model_loading import WeightRenaming, apply_renamings

    reverse = [c.reverse_transform() for c in reversed(conversions)]
    renamings = [r for r in reverse if isinstance(r, WeightRenaming)]
    return lambda key: apply_renamings(key, renamings)


def _write_checkpoint(model: nn.Module, src: str, dst: str, src_config: dict[str, Any], src_files: dict[str, str],
                      products: dict[str, torch.Tensor], linears: dict[str, nn.Module],
                      experts: dict[str, nn.Module]) -> list[str]:
    """Write the tensors and files; returns the top-level name prefixes of SRC tensors the model lacks."""
    import torch

    from safetensors import safe_open
    from safetensors.torch import save_file

    rename = _checkpoint_renamer(model)

    def ckpt(key: str) -> str:
        out = rename(key)
        return out if out in src_files or key not in src_files else key

    # SRC tensors the quantized ones replace.
    consumed: set[str] = set()
    for name in linears:
        key = ckpt(f"{name}.weight")
        if key not in src_files:
            raise CheckpointError(f"{src}: no checkpoint tensor for {name}.weight (looked for {key!r})")
        consumed.add(key)
    for name, module in experts.items():
        fused = [ckpt(f"{name}.gate_up_proj"), ckpt(f"{name}.down_proj")]
        per_expert = [ckpt(f"{name}.{e}.{p}.weight") for e in range(module.gate_up_proj.shape[0])
                      for p in ("gate_proj", "up_proj", "down_proj")]
        if all(k in src_files for k in fused):
            consumed.update(fused)
        elif all(k in src_files for k in per_expert):
            consumed.update(per_expert)
        else:
            raise CheckpointError(f"{src}: no checkpoint tensors for the experts {name} (looked for {fused[0]!r} "
                                  f"and {per_expert[0]!r})")

    out: dict[str, torch.Tensor | str] = {rename(k): v for k, v in products.items()}
    for key in src_files:
        if key not in consumed and key not in out:
            out[key] = src_files[key]  # copied byte for byte below

    def natural(key: str) -> list:
        return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", key)]

    names = sorted(out, key=natural)
    handles: dict[str, Any] = {}

    def nbytes(key: str) -> int:
        value = out[key]
        if isinstance(value, torch.Tensor):
            return value.numel() * value.element_size()
        h = handles.setdefault(value, safe_open(os.path.join(src, value), framework="pt"))
        sl = h.get_slice(key)
        size = 1
        for d in sl.get_shape():
            size *= d
        return size * _DTYPE_BYTES.get(sl.get_dtype(), 4)

    sizes = {key: nbytes(key) for key in names}
    shards: list[list[str]] = [[]]
    size = 0
    for key in names:
        if shards[-1] and size + sizes[key] > _SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += sizes[key]
    total = sum(sizes.values())

    os.makedirs(dst, exist_ok=True)
    weight_map: dict[str, str] = {}
    for i, keys in enumerate(shards):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for key in keys:
            value = out[key]
            tensors[key] = (value if isinstance(value, torch.Tensor) else handles[value].get_tensor(key)).contiguous()
            weight_map[key] = fname
        save_file(tensors, os.path.join(dst, fname), metadata={"format": "pt"})
        del tensors
    if len(shards) > 1:
        with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)

    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(src_config, f, indent=2)
    for fname in os.listdir(src):  # tokenizer, generation config, chat template, ...
        path = os.path.join(src, fname)
        if (os.path.isfile(path) and fname != "config.json" and not fname.endswith(_WEIGHT_SUFFIXES)
                and not fname.endswith(".index.json")):
            shutil.copy2(path, os.path.join(dst, fname))
    roots = {rename(f"{n}.x").split(".", 1)[0] for n, _ in model.named_children()}
    return sorted({k.split(".", 1)[0] for k in src_files if "." in k and k.split(".", 1)[0] not in roots})


_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
                "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "BOOL": 1}


# ------------------------------------------------------------------------------------------------------ CLI


def cmd_quantize(args: argparse.Namespace, out: TextIO) -> int:
    quantize_checkpoint(args.src, args.dst, args.scheme, ignore=args.ignore or (),
                        show_progress=not getattr(args, "no_progress", False))
    with open(os.path.join(args.dst, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    out.write(f"wrote {args.dst}: {normalize_scheme(args.scheme)} ({qc['format']}), "
              f"ignore={qc.get('ignore')}\n")
    return 0


def add_quantize_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``quantize`` to the ``vtcore`` subcommands (``sub`` is an argparse subparsers object)."""
    p = sub.add_parser("quantize", help="quantize an HF checkpoint to a compressed-tensors FP4 checkpoint",
                       description="Quantize every Linear (but lm_head) and the MoE experts of an HF checkpoint "
                                   "with compressed-tensors and write a compressed-tensors checkpoint.")
    p.add_argument("src", help="HF checkpoint folder (config.json + *.safetensors)")
    p.add_argument("dst", help="output folder (must not exist or be empty)")
    p.add_argument("--scheme", required=True, metavar="SCHEME",
                   help=f"one of {', '.join(SCHEMES)} (A16: weight-only; NVFP4 calibrates static input scales "
                        "on a built-in text)")
    p.add_argument("--ignore", action="append", default=None, metavar="NAME",
                   help="also leave this module unquantized: a module name or a 're:' regex (repeatable); "
                        "lm_head is always left")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_quantize)
    return p
