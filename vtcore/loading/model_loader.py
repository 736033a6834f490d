"""Build a model for a checkpoint: find its family, construct it, apply the hooks once, load weights."""
from __future__ import annotations

import torch
from torch import nn

from vtcore.config import HFConfig
from vtcore.errors import NoMTPHead, PluginError
from vtcore.family import ModelFamily
from vtcore.layers.embedding import EmbedInto
from vtcore.layers.parallel import refuse_unsharded
from vtcore.layers.quantized import take_over
from vtcore.plugins.manager import Plugins, get_plugins


def build_model(model_path: str, hf_config: HFConfig, device: torch.device, dtype: torch.dtype,
                max_position: int, load_format: str = "auto", seed: int = 0, mtp: bool = False
                ) -> tuple[nn.Module, ModelFamily]:
    """Construct the family's model on ``device`` in ``dtype`` and fill its weights; ``mtp``: with its
    multi-token-prediction head as ``model.mtp`` (``vtcore_mtp_head``), refused naming the family when
    no plugin builds one."""
    plugins = get_plugins()
    family = plugins.family_for(hf_config.architecture)
    loader = plugins.loader(load_format)
    cls = family.load_class()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(hf_config, max_position=max_position)
            if mtp:
                _attach_mtp_head(plugins, family, model, hf_config)
    finally:
        torch.set_default_dtype(previous)
    refuse_unsharded(model)
    quant = hf_config.get("quantization_config")
    if quant:
        take_over(model, plugins.quant_method(quant_format(quant))(quant))
    for name, module in list(model.named_modules()):
        if isinstance(module, EmbedInto):
            module.family = family.name
            try:
                replacement = plugins.pm.hook.vtcore_embed_into(family=family, embed=module)
            except Exception as exc:  # plugin code: say whose hook failed
                hooked = [i.plugin_name for i in plugins.pm.hook.vtcore_embed_into.get_hookimpls()]
                raise PluginError(f"vtcore_embed_into (implemented by {hooked}) raised building family "
                                  f"{family.name!r}: {type(exc).__name__}: {exc}") from exc
            if replacement is not None:
                _replace_module(model, name, module, replacement)
    with torch.no_grad():
        loader(model, model_path, hf_config, seed)
    return model.eval(), family


def _attach_mtp_head(plugins: Plugins, family: ModelFamily, model: nn.Module, hf_config: HFConfig) -> None:
    try:
        head = plugins.pm.hook.vtcore_mtp_head(family=family, model=model, hf_config=hf_config)
    except Exception as exc:  # plugin code: say whose hook failed
        hooked = [i.plugin_name for i in plugins.pm.hook.vtcore_mtp_head.get_hookimpls()]
        raise PluginError(f"vtcore_mtp_head (implemented by {hooked}) raised building family {family.name!r}: "
                          f"{type(exc).__name__}: {exc}") from exc
    if head is None:
        raise NoMTPHead(f"family {family.name!r} ({hf_config.architecture}) has no multi-token-prediction head "
                          f"for this checkpoint: no plugin's vtcore_mtp_head builds one (a Qwen3.5 checkpoint "
                          f"declares mtp_num_hidden_layers > 0)")
    head.attach(model)


def _replace_module(model: nn.Module, name: str, old: nn.Module, new: nn.Module) -> None:
    """Swap ``old`` for ``new`` at ``name``; weights tied to ``old.weight`` (a tied lm_head) follow it."""
    tied = [m for m in model.modules() if m is not old and getattr(m, "weight", None) is old.weight]
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, new)
    if isinstance(getattr(new, "weight", None), nn.Parameter):
        for m in tied:
            m.weight = new.weight


def quant_format(quant_config: dict) -> str:
    """The compressed-tensors format of a quantization_config (top level, or shared by its groups)."""
    formats = {g.get("format") for g in (quant_config.get("config_groups") or {}).values() if g.get("format")}
    fmt = quant_config.get("format") or (formats.pop() if len(formats) == 1 else None)
    if not fmt:
        raise ValueError(f"quantization_config: no single 'format' found (quant_method="
                         f"{quant_config.get('quant_method')!r}, group formats {sorted(formats)}); expected a "
                         "compressed-tensors format such as 'nvfp4-pack-quantized'")
    return fmt
