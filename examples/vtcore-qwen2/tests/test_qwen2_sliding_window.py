"""A config with sliding-window layers is refused by name (vtcore attends over the whole context)."""
import pytest

from vtcore.config import HFConfig
from vtcore.errors import NotSupportedError
from vtcore_qwen2.model import Qwen2ForCausalLM
from vtcore_qwen2.plugin import conformance_example


@pytest.mark.parametrize("fields", [{"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 1},
                                    {"layer_types": ["full_attention", "sliding_attention"]}])
def test_sliding_window_config_is_refused(fields) -> None:
    with pytest.raises(NotSupportedError, match="sliding-window attention"):
        Qwen2ForCausalLM(HFConfig({**conformance_example().hf_config, **fields}), 64)
