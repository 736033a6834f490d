"""``vtcore new-plugin NAME --arch ARCH``: a pip-installable model-family plugin package to fill in."""
from __future__ import annotations

import os
import re

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_ARCH = re.compile(r"^[A-Z][A-Za-z0-9_]*$")  # a class name, as config.json's "architectures" lists it

PYPROJECT = '''[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "{dist}"
version = "0.1.0"
description = "vtcore plugin: the {arch} model family."
requires-python = ">=3.11"
dependencies = ["vtcore"]

[project.optional-dependencies]
test = ["pytest>=8"]  # the gate's tests; vtcore ships their pytest plugin

[project.entry-points.vtcore]
{name} = "{module}.plugin"

[tool.setuptools.packages.find]
include = ["{module}*"]
'''

PLUGIN = '''"""Hook implementations: register the {name} family and its conformance example."""
from __future__ import annotations

from vtcore import hookimpl
from vtcore.family import ConformanceExample, ModelFamily


@hookimpl
def vtcore_model_families() -> list[ModelFamily]:
    return [ModelFamily(
        name="{name}",
        architectures=("{arch}",),
        model_cls="{module}.model:{arch}",
        consumes_device_tokens=True,  # true once the model embeds through vtcore's EmbedInto
        conformance_example="{module}.plugin:conformance_example",
    )]


def conformance_example() -> ConformanceExample:
    """A tiny config of {arch} (2+ layers, initializer_range near 0.1) and its HF oracle class."""
    return ConformanceExample(hf_config={config}, oracle="transformers:{arch}")
'''

MODEL = '''"""{arch} for vtcore: build it from vtcore's shared layers (docs/writing-a-plugin.md).

Contract with the engine: ``__init__(config: HFConfig, max_position: int)``;
``forward(input_ids, positions) -> hidden [tokens, hidden]`` with the tokens of every request laid
out flat; ``compute_logits(hidden) -> [rows, vocab]``; tokens embedded through
``vtcore.layers.embedding.EmbedInto``; attention through ``vtcore.layers.attention.Attention``
(paged KV cache); fused projections named in ``packed_modules_mapping``.
"""
from __future__ import annotations

from torch import nn

from vtcore.config import HFConfig


class {arch}(nn.Module):
    packed_modules_mapping: dict[str, tuple[str, str]] = {{}}

    def __init__(self, config: HFConfig, max_position: int) -> None:
        super().__init__()
        raise NotImplementedError(
            "{module}.model.{arch} is an unfinished scaffold: write its layers and forward from "
            "vtcore.layers (EmbedInto, Linear, RMSNorm, RotaryEmbedding, Attention), as docs/writing-a-plugin.md shows")
'''

TEST = '''"""The vtcore conformance gate on this plugin's family."""
from vtcore.conformance.suite import ConformanceSuite


class Test{camel}Conformance(ConformanceSuite):
    family = "{name}"
'''

README = '''# {dist}

A vtcore plugin serving `{arch}`. Install it, then prove it:

```bash
pip install -e ".[test]"      # the plugin, and pytest for its own tests (the `test` extra)
vtcore models
vtcore conformance --family {name}
python -m pytest tests        # the same gate, one test per check
```
'''


def tiny_config(arch: str) -> dict:
    """A tiny config for ``arch``; the model_type is that of the class's own config class when
    transformers knows the class (not the first auto-mapping entry naming it: several model types
    map to LlamaForCausalLM, and 'exaone' comes first)."""
    import transformers

    try:
        model_type = getattr(transformers, arch).config_class.model_type
    except (AttributeError, ImportError):
        model_type = "TODO-model-type"
    return {"architectures": [arch], "model_type": model_type, "vocab_size": 512, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
            "initializer_range": 0.1}


def new_plugin(name: str, arch: str, directory: str) -> str:
    """Write the package ``vtcore-<name>`` under ``directory``; returns its path."""
    if not _NAME.match(name):
        raise ValueError(f"NAME={name!r}: expected a lowercase identifier such as 'llama' or 'my_family'")
    if not _ARCH.match(arch):
        raise ValueError(f"--arch={arch!r}: expected an HF architecture class name such as 'LlamaForCausalLM' (as "
                         "config.json's 'architectures' lists it; not a model_type such as 'llama')")
    dist, module = "vtcore-" + name.replace("_", "-"), "vtcore_" + name
    root = os.path.join(directory, dist)
    if os.path.exists(root):
        raise FileExistsError(f"{root} already exists; choose another NAME or directory")
    fields = dict(name=name, arch=arch, dist=dist, module=module,
                  camel="".join(p.title() for p in name.split("_")),
                  config="{\n" + "".join(f"        {k!r}: {v!r},\n" for k, v in tiny_config(arch).items()) + "    }")
    files = {"pyproject.toml": PYPROJECT, f"{module}/__init__.py": f'"""vtcore plugin: {arch}."""\n',
             f"{module}/plugin.py": PLUGIN, f"{module}/model.py": MODEL,
             f"tests/test_{name}_conformance.py": TEST, "README.md": README}
    for rel, template in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(template.format(**fields))
    return root
