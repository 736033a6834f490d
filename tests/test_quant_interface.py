"""The quant take-over interface (vtcore.quant.base, vtcore.layers.quantized): one method serves Linear and
the MoE Experts through specs and tensors alone, a layer is quantized all or none, shared tensors load one
value, and FP4 computes an expert exactly as a Linear holding the same tensors."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from vtcore.errors import CheckpointError
from vtcore.layers.linear import Linear
from vtcore.layers.moe import Experts
from vtcore.layers.quantized import take_over
from vtcore.quant.base import QuantMethod, QuantTensor, QuantWeights, WeightSpec
from vtcore_quant_nvfp4.method import NVFP4Method

E, H, I = 3, 32, 16


class Int8Rows(QuantMethod):
    """A toy format: int8 codes and one float32 scale per row, an input scale shared by a matrix's shards."""

    def __init__(self, skip: tuple[str, ...] = ()) -> None:
        super().__init__({})
        self.skip = skip

    def quantizes(self, module: str) -> bool:
        return not module.endswith(self.skip) if self.skip else True

    def create_weights(self, spec: WeightSpec, device: torch.device) -> dict[str, QuantTensor]:
        return {"codes": QuantTensor(torch.empty(*spec.lead, spec.rows, spec.in_features, dtype=torch.int8)),
                "row_scale": QuantTensor(torch.empty(*spec.lead, spec.rows)),
                "input_scale": QuantTensor(torch.full((*spec.lead, len(spec.shards)), float("nan")), per_shard=True,
                                           shared=True)}

    def dense(self, w: QuantWeights) -> torch.Tensor:
        return w["codes"].float() * w["row_scale"][:, None]

    def apply(self, weights: QuantWeights, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x * weights["input_scale"][:1], self.dense(weights), bias)

    def dummy_init(self, weights: QuantWeights, gen: torch.Generator) -> None:
        weights["codes"].copy_(torch.randint(-127, 128, weights["codes"].shape, generator=gen))
        weights["row_scale"].fill_(0.01)
        weights["input_scale"].fill_(1.0)


def _model() -> nn.Module:
    model = nn.Module()
    model.packed_modules_mapping = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k")}
    model.qkv_proj = Linear(H, [("q", 8), ("k", 4)], bias=True)
    model.experts = Experts(E, H, I)
    return model


def test_one_method_takes_over_linear_and_experts_and_computes_from_the_loaded_tensors() -> None:
    model, method = _model(), Int8Rows()
    take_over(model, method)
    lin, exp = model.qkv_proj, model.experts
    assert lin.weight is None and exp.gate_up_proj is None and exp.down_proj is None
    assert lin.codes.shape == (12, H) and exp.gate_up_codes.shape == (E, 2 * I, H) and exp.down_codes.shape == (E, H, I)
    gen = torch.Generator().manual_seed(0)
    # load as the checkpoint loader does: one tensor per shard (per expert and projection)
    for shard, rows in (("q", 8), ("k", 4)):
        lin.codes.weight_loader(lin.codes, torch.randint(-127, 128, (rows, H), generator=gen, dtype=torch.int8), shard)
        lin.row_scale.weight_loader(lin.row_scale, torch.rand(rows, generator=gen), shard)
        lin.input_scale.weight_loader(lin.input_scale, torch.tensor([0.5]), shard)
    lin.bias.data.normal_(generator=gen)
    for e in range(E):
        for p, rows, k in (("gate", I, H), ("up", I, H), (None, H, I)):
            shard = f"{e}.{p}" if p else str(e)
            prefix = "down_" if p is None else "gate_up_"
            codes, scale, inp = (getattr(exp, prefix + n) for n in ("codes", "row_scale", "input_scale"))
            codes.weight_loader(codes, torch.randint(-127, 128, (rows, k), generator=gen, dtype=torch.int8), shard)
            scale.weight_loader(scale, torch.rand(rows, generator=gen) / 10, shard)
            inp.weight_loader(inp, torch.tensor([1.5]), shard)
    x = torch.randn(5, H, generator=gen)
    want = F.linear(x * 0.5, lin.codes.float() * lin.row_scale[:, None], lin.bias)
    assert torch.equal(lin(x), want)
    ids = torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1], [2, 0]])
    weights = torch.softmax(torch.randn(5, 2, generator=gen), -1)
    want = torch.zeros_like(x)
    for t in range(5):
        for j in range(2):
            e = int(ids[t, j])
            gu = exp.gate_up_codes[e].float() * exp.gate_up_row_scale[e][:, None]
            d = exp.down_codes[e].float() * exp.down_row_scale[e][:, None]
            h = F.linear(x[t] * 1.5, gu)
            want[t] += weights[t, j] * F.linear(F.silu(h[:I]) * h[I:] * 1.5, d)
    torch.testing.assert_close(exp(x, ids, weights), want, rtol=1e-4, atol=1e-4)
    assert not exp.supports_decode_graphs  # the toy method offers no fused-MoE operand
    exp.quant_dummy_init(torch.Generator().manual_seed(1))
    assert exp.gate_up_row_scale.eq(0.01).all() and exp.down_input_scale.eq(1.0).all()


def test_a_layer_is_quantized_all_or_none() -> None:
    with pytest.raises(CheckpointError, match=r"qkv_proj: the quantization_config quantizes \['q_proj'\] but not "
                                              r"\['k_proj'\].*all or none"):
        take_over(_model(), Int8Rows(skip=("k_proj",)))
    with pytest.raises(CheckpointError, match=r"experts: .*but not \['experts\.1\.down_proj'\].*all or none"):
        take_over(_model(), Int8Rows(skip=("experts.1.down_proj", "k_proj", "q_proj")))
    model = _model()
    take_over(model, Int8Rows(skip=("k_proj", "q_proj")))  # none of the Linear: it stays dense
    assert model.qkv_proj.quant is None and model.qkv_proj.weight is not None and model.experts.quant is not None


def test_a_shared_tensor_loads_one_value_per_matrix() -> None:
    model = _model()
    take_over(model, Int8Rows())
    inp = model.experts.gate_up_input_scale
    inp.weight_loader(inp, torch.tensor([2.0]), "1.gate")
    inp.weight_loader(inp, torch.tensor([3.0]), "0.up")  # another expert: no conflict
    with pytest.raises(ValueError, match=r"experts\.1\.gate_proj\.input_scale = 2\.0 and "
                                         r"experts\.1\.up_proj\.input_scale = 3\.0 differ"):
        inp.weight_loader(inp, torch.tensor([3.0]), "1.up")


def _nvfp4() -> NVFP4Method:
    return NVFP4Method({"config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "type": "float", "group_size": 16}}}, "ignore": ["lm_head"]})


@torch.no_grad()
def test_fp4_expert_equals_a_linear_holding_its_tensors() -> None:
    experts, method = Experts(E, H, I), _nvfp4()
    take_over(experts, method)
    experts.quant_dummy_init(torch.Generator().manual_seed(4))
    experts.gate_up_weight_global_scale.copy_(torch.tensor([[60.0, 70.0], [50.0, 64.0], [80.0, 40.0]]))
    gate_up = Linear(H, [("gate", I), ("up", I)])
    take_over(gate_up, method)
    e = 2
    for name in ("weight_packed", "weight_scale", "weight_global_scale"):
        src, dst = getattr(experts, "gate_up_" + name)[e], getattr(gate_up, name)
        if name == "weight_global_scale":
            for i, shard in enumerate(("gate", "up")):
                dst.weight_loader(dst, src[i:i + 1], shard)
        else:
            dst.weight_loader(dst, src, None)
    x = torch.randn(4, H, generator=torch.Generator().manual_seed(5))
    assert torch.equal(experts._project(x, "gate_up_proj", e), gate_up(x))
    assert method.gemv_weight(experts.quant_weights["gate_up_proj"]) is None  # a stack: no GEMV operand
    assert experts.supports_decode_graphs  # W4A16: the fused MoE takes the packed stack


def test_fp4_ignores_modules_under_an_ignored_one() -> None:
    method = _nvfp4()
    method.ignore += ["model.layers.0.mlp.experts", "re:.*\\.mlp\\.gate$"]
    assert not method.quantizes("model.layers.0.mlp.experts.3.down_proj")
    assert method.quantizes("model.layers.1.mlp.experts.3.down_proj")
    assert not method.quantizes("model.layers.1.mlp.gate") and method.quantizes("model.layers.1.mlp.gate_proj")
    assert not method.quantizes("lm_head")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.no_grad()
def test_cuda_fast_paths_take_the_quantized_weights() -> None:
    """On CUDA the fused MoE takes the stack through ``experts_operand`` and a one-row Linear the FP4 GEMV
    through ``gemv_weight``: both agree with the per-matrix torch reference of the same tensors."""
    method = _nvfp4()
    experts = Experts(8, 64, 32, top_k=2)
    take_over(experts, method)
    experts.quant_dummy_init(torch.Generator().manual_seed(6))
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(7))
    ids = torch.tensor([[0, 3], [7, 1], [3, 2], [5, 6], [4, 0]])
    weights = torch.softmax(torch.randn(5, 2, generator=torch.Generator().manual_seed(8)), -1)
    want = experts(x, ids, weights)  # CPU: the loop over apply
    gpu = experts.cuda()
    assert gpu.fused(x.cuda())
    torch.testing.assert_close(gpu(x.cuda(), ids.cuda(), weights.cuda()).cpu(), want, rtol=2e-4, atol=2e-4)
    lin = Linear(64, [("gate", 32), ("up", 32)])
    take_over(lin, method)
    lin.quant_dummy_init(torch.Generator().manual_seed(9))
    row = x[:1]
    want = lin(row)
    lin = lin.cuda()
    assert lin._gemv_weight(row.cuda()) is not None
    torch.testing.assert_close(lin(row.cuda()).cpu(), want, rtol=2e-4, atol=2e-4)


def test_a_family_s_quant_ignore_is_checked_when_registered() -> None:
    from vtcore.family import ModelFamily

    kw = dict(name="f", architectures=("FForCausalLM",), model_cls="m:F")
    assert ModelFamily(**kw, quant_ignore=["lm_head", r"re:.*\.gate$"]).quant_ignore == ("lm_head", r"re:.*\.gate$")
    with pytest.raises(ValueError, match=r"quant_ignore='lm_head': expected a tuple of module names"):
        ModelFamily(**kw, quant_ignore="lm_head")
    with pytest.raises(ValueError, match=r"quant_ignore pattern 're:\(': not a valid regular expression"):
        ModelFamily(**kw, quant_ignore=("re:(",))
