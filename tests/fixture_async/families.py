"""Fixture plugin: Qwen3 variants that each break one part of the contract, on purpose.

Every family but ``no_example`` carries a conformance example whose oracle is HF's Qwen3 class,
so the gate can show which single check each one fails.
"""
from __future__ import annotations

from typing import Any

import attrs
import torch
from torch import nn
from torch.nn import functional as F

from transformers import Qwen3ForCausalLM as HFQwen3ForCausalLM

from vtcore import hookimpl
from vtcore.family import ConformanceExample, ModelFamily
from vtcore.layers.attention import Attention, get_attention_metadata, set_attention_metadata
from vtcore.layers.gated_deltanet import GatedDeltaNet
from vtcore.layers.linear import Linear
from vtcore.layers.norm import RMSNorm, rms_norm
from vtcore.layers.rotary import RotaryEmbedding
from vtcore_qwen3_5.model import Qwen3_5ForCausalLM
from vtcore_qwen3_5.plugin import dense_example as qwen3_5_example
from vtcore_qwen3_dense.model import Qwen3ForCausalLM
from vtcore_qwen3_dense.plugin import conformance_example as qwen3_example

HERE = "tests.fixture_async.families"


class _HostEmbedding(nn.Module):
    """Embeds whatever host ids it is given: ignores the device-token override."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, input_ids):
        return F.embedding(input_ids, self.weight)


class IgnoresOverride(Qwen3ForCausalLM):
    """Keeps an EmbedInto around (so the structure check passes) but embeds with its own module."""

    def __init__(self, config, max_position: int) -> None:
        super().__init__(config, max_position)
        self.unused_embed = self.model.embed_tokens
        self.model.embed_tokens = _HostEmbedding(self.unused_embed.weight)


class SwappedGateUp(Qwen3ForCausalLM):
    """Loads gate_proj into the up rows and up_proj into the gate rows: a wrong weight mapping."""

    packed_modules_mapping = {**Qwen3ForCausalLM.packed_modules_mapping,
                              "gate_proj": ("gate_up_proj", "up"), "up_proj": ("gate_up_proj", "gate")}


class LossyLoad(Qwen3ForCausalLM):
    """Rounds one weight through bfloat16 while loading: close, but not the checkpoint's bits."""

    def __init__(self, config, max_position: int) -> None:
        super().__init__(config, max_position)
        o_proj = self.model.layers[0].self_attn.o_proj

        def lossy(param, loaded, shard=None):
            Linear.weight_loader(o_proj, param, loaded.to(torch.bfloat16).float(), shard)

        o_proj.weight.weight_loader = lossy


class _WeightlessNorm(RMSNorm):
    """Normalises but never scales by its weight (loaded all the same)."""

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, torch.zeros_like(self.weight) if self.zero_centered else torch.ones_like(self.weight),
                        self.eps, self.zero_centered)


class IgnoresNormWeight(Qwen3ForCausalLM):
    """Every layer's input_layernorm ignores its weight: right only while the weights are at their init (1)."""

    def __init__(self, config, max_position: int) -> None:
        super().__init__(config, max_position)
        for layer in self.model.layers:
            layer.input_layernorm.__class__ = _WeightlessNorm


class WrongRopeTheta(Qwen3ForCausalLM):
    """Rotates with twice the checkpoint's rope_theta: every position past 0 is a little wrong, and no oracle tensor's
    reset explains it."""

    def __init__(self, config, max_position: int) -> None:
        super().__init__(config, max_position)
        wrong = RotaryEmbedding(config.head_dim, max_position, 2 * config.rope_theta, config.rope_parameters)
        rotary = self.model.layers[0].self_attn.rotary  # (one module, shared by every layer)
        rotary.cos_cache.copy_(wrong.cos_cache)
        rotary.sin_cache.copy_(wrong.sin_cache)


class _UndeclaredNorm(RMSNorm):
    """A norm of a family's own that says nothing about tensor parallelism."""

    tp_replicated = False


class UnshardedNorm(Qwen3ForCausalLM):
    """Right on one rank; above one its own norm neither shards nor declares itself replicated."""

    def __init__(self, config, max_position: int) -> None:
        super().__init__(config, max_position)
        self.model.norm.__class__ = _UndeclaredNorm


class _RankZeroRowLinear(Linear):
    """A row-parallel Linear whose loader keeps rank 0's columns on every rank: right on one rank only."""

    def _rank_part(self, param, loaded, shard):
        return loaded if self.parallel is None or loaded.dim() == 1 else loaded.narrow(1, 0, self.in_features)


class RankZeroOProj(Qwen3ForCausalLM):
    """Every layer's o_proj loads rank 0's part of its weight on every rank."""

    def __init__(self, config, max_position: int) -> None:
        super().__init__(config, max_position)
        for layer in self.model.layers:
            layer.self_attn.o_proj.__class__ = _RankZeroRowLinear


class FailsOnRank1(Qwen3ForCausalLM):
    """Cannot be built as rank 1 of several (a worker that dies while building its share)."""

    def __init__(self, config, max_position: int) -> None:
        from vtcore.layers.parallel import tp

        if tp().rank == 1:
            raise RuntimeError("rank 1 cannot build this model")
        super().__init__(config, max_position)


class _OwnTokensAttention(Attention):
    """Prefill attends over the step's own K/V only, not the context already in the cache: right while
    every prompt is prefilled whole in one step."""

    def forward(self, q, k, v, positions=None, rotary=None, q_norm=None, k_norm=None):
        md = get_attention_metadata()
        if md.decode:
            return super().forward(q, k, v, positions, rotary, q_norm, k_norm)
        q, k = rotary(positions, q, k, q_norm, k_norm, kv_cache=(v, self.k_cache, self.v_cache, md.slot_mapping))
        group = self.num_heads // self.num_kv_heads
        starts = md.query_start_loc.tolist()
        out = []
        for a, b in zip(starts[:-1], starts[1:]):
            qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)))
            out.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=self.scale).transpose(0, 1))
        return torch.cat(out).reshape(-1, self.num_heads * self.head_dim)


class _Qwen3WithAttention(Qwen3ForCausalLM):
    """Qwen3 whose every attention layer is of class ``attention``."""

    attention: type[Attention] = Attention

    def __init__(self, config, max_position: int) -> None:
        super().__init__(config, max_position)
        for layer in self.model.layers:
            layer.self_attn.attn.__class__ = self.attention


class PrefillIgnoresCache(_Qwen3WithAttention):
    attention = _OwnTokensAttention


class _ShiftedCachedPrefix(Attention):
    """A prefill chunk that starts on a block boundary after cached blocks (a prefix-cache hit; chunked
    prefills rarely start there) takes its positions one too low: right whenever a prompt's first
    chunk starts at position 0."""

    def forward(self, q, k, v, positions=None, rotary=None, q_norm=None, k_norm=None):
        md = get_attention_metadata()
        if not md.decode and positions is not None:
            lens = (md.query_start_loc[1:] - md.query_start_loc[:-1]).long()
            starts = md.context_lens.long() - lens
            shift = ((starts > 0) & (starts % self.block_size == 0)).long()
            positions = positions - torch.repeat_interleave(shift, lens)
        return super().forward(q, k, v, positions, rotary, q_norm, k_norm)


class CachedPrefixOffByOne(_Qwen3WithAttention):
    attention = _ShiftedCachedPrefix


class _HostContextLength(Attention):
    """A chunk of one sequence alone attends over ``max_context_len`` keys, the host's bound, not the
    device's ``context_lens``: the same where the host knows the positions; a share that floats over an
    unsettled verify row (the host's bound counts every draft token as accepted) reads keys past its end."""

    def attend(self, q):
        md = get_attention_metadata()
        if md.decode or md.context_lens.numel() != 1:
            return super().attend(q)
        set_attention_metadata(attrs.evolve(md, context_lens=torch.full_like(md.context_lens, md.max_context_len)))
        try:
            return super().attend(q)
        finally:
            set_attention_metadata(md)


class HostContextLength(_Qwen3WithAttention):
    attention = _HostContextLength


class _StickyStateGDN(GatedDeltaNet):
    """Its decode path always continues the slot's state ("a decode row never starts a sequence"): a
    one-token prompt arriving in a decode step on a freed slot inherits the old owner's state."""

    def _decode_indexed(self, mixed, b, a, slots, continues, out_slots=None):
        return super()._decode_indexed(mixed, b, a, slots, torch.ones_like(continues), out_slots)


class _VerifyStateOnlyAtEndGDN(GatedDeltaNet):
    """Declares verify graphs but keeps only a verify row's final state (in its own slot), not the state
    after each token in the draft-state slots: a partly accepted draft resumes from a stale state."""

    def _decode_indexed(self, mixed, b, a, slots, continues, out_slots=None):
        if out_slots is not None:
            out_slots = torch.where(out_slots == slots[:, None], out_slots, -1)
        return super()._decode_indexed(mixed, b, a, slots, continues, out_slots)


class _Qwen3_5WithGDN(Qwen3_5ForCausalLM):
    """Qwen3.5 whose Gated DeltaNet layers are of the class ``gdn``."""

    gdn: type[GatedDeltaNet]

    def __init__(self, config, max_position: int) -> None:
        super().__init__(config, max_position)
        for m in self.modules():
            if isinstance(m, GatedDeltaNet):
                m.__class__ = self.gdn


class StateNotReset(_Qwen3_5WithGDN):
    gdn = _StickyStateGDN


class _SnapshotIntoReadSlotGDN(GatedDeltaNet):
    """Claims the snapshot contract but ends every segment in the slot it started from (ignores
    ``state_out_slots``): a snapshot taken inside a prefill chunk is never written."""

    def _forward_per_sequence(self, mixed, b, a, md):
        md.state_out_slots = []
        return super()._forward_per_sequence(mixed, b, a, md)


class VerifyStateOnlyAtEnd(_Qwen3_5WithGDN):
    gdn = _VerifyStateOnlyAtEndGDN


class SnapshotIntoReadSlot(_Qwen3_5WithGDN):
    gdn = _SnapshotIntoReadSlotGDN


class _PaddingIntoStateGDN(GatedDeltaNet):
    """Declares chunk graphs but runs a padded lone prefill chunk as if every row were real (ignores
    ``state_tokens``): the padding's tokens change the state a later step continues from."""

    def _chunk_indexed(self, mixed, b, a, slot, continues, tokens):
        return super()._chunk_indexed(mixed, b, a, slot, continues, torch.full_like(tokens, mixed.shape[0]))


class PaddingIntoState(_Qwen3_5WithGDN):
    gdn = _PaddingIntoStateGDN


class DeadTensorOracle(HFQwen3ForCausalLM):
    """HF's Qwen3 with a tensor its forward never reads: no family can be checked on it."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.model.unused = nn.Linear(4, 4, bias=False)


class DeadTensor(Qwen3ForCausalLM):
    def __init__(self, config, max_position: int) -> None:
        super().__init__(config, max_position)
        self.skipped_tensors = (*self.skipped_tensors, "model.unused.weight")


def _example(arch: str, **overrides: Any) -> ConformanceExample:
    base = qwen3_example()
    return ConformanceExample(hf_config={**base.hf_config, "architectures": [arch], **overrides}, oracle=base.oracle)


def ignores_override_example() -> ConformanceExample:
    return _example("IgnoresOverrideForCausalLM")


def undeclared_example() -> ConformanceExample:
    return _example("UndeclaredForCausalLM")


def one_layer_example() -> ConformanceExample:
    return _example("OneLayerForCausalLM", num_hidden_layers=1)


def flat_example() -> ConformanceExample:
    # Tied embeddings and near-zero layers: the model echoes its last token.
    return _example("FlatForCausalLM", initializer_range=1e-3, tie_word_embeddings=True)


def swapped_example() -> ConformanceExample:
    return _example("SwappedGateUpForCausalLM")


def lossy_example() -> ConformanceExample:
    return _example("LossyLoadForCausalLM")


def ignores_norm_weight_example() -> ConformanceExample:
    return _example("IgnoresNormWeightForCausalLM")


def wrong_rope_theta_example() -> ConformanceExample:
    return _example("WrongRopeThetaForCausalLM")


def prefill_ignores_cache_example() -> ConformanceExample:
    return _example("PrefillIgnoresCacheForCausalLM")


def cached_prefix_off_by_one_example() -> ConformanceExample:
    return _example("CachedPrefixOffByOneForCausalLM")


def host_context_length_example() -> ConformanceExample:
    return _example("HostContextLengthForCausalLM")


def unsharded_norm_example() -> ConformanceExample:
    return _example("UnshardedNormForCausalLM")


def rank_zero_o_proj_example() -> ConformanceExample:
    return _example("RankZeroOProjForCausalLM")


def fails_on_rank1_example() -> ConformanceExample:
    return _example("FailsOnRank1ForCausalLM")


def _hybrid_example(arch: str) -> ConformanceExample:
    base = qwen3_5_example()
    return ConformanceExample(hf_config={**base.hf_config, "architectures": [arch]}, oracle=base.oracle)


def state_not_reset_example() -> ConformanceExample:
    return _hybrid_example("StateNotResetForCausalLM")


def verify_state_only_at_end_example() -> ConformanceExample:
    return _hybrid_example("VerifyStateOnlyAtEndForCausalLM")


def snapshot_into_read_slot_example() -> ConformanceExample:
    return _hybrid_example("SnapshotIntoReadSlotForCausalLM")


def padding_into_state_example() -> ConformanceExample:
    return _hybrid_example("PaddingIntoStateForCausalLM")


def dead_tensor_example() -> ConformanceExample:
    return ConformanceExample(hf_config={**qwen3_example().hf_config, "architectures": ["DeadTensorForCausalLM"]},
                              oracle=f"{HERE}:DeadTensorOracle")


def wrong_model_type_example() -> ConformanceExample:
    # qwen3_moe configs build other tensor names: the gate would blame the family for them
    return _example("WrongModelTypeForCausalLM", model_type="qwen3_moe")


@hookimpl
def vtcore_model_families() -> list[ModelFamily]:
    qwen3 = "vtcore_qwen3_dense.model:Qwen3ForCausalLM"
    return [
        ModelFamily(name="ignores_override", architectures=("IgnoresOverrideForCausalLM",),
                    model_cls=f"{HERE}:IgnoresOverride", consumes_device_tokens=True,
                    conformance_example=f"{HERE}:ignores_override_example"),
        ModelFamily(name="undeclared", architectures=("UndeclaredForCausalLM",), model_cls=qwen3,
                    consumes_device_tokens=False, conformance_example=f"{HERE}:undeclared_example"),
        ModelFamily(name="no_example", architectures=("NoExampleForCausalLM",), model_cls=qwen3,
                    consumes_device_tokens=True),
        ModelFamily(name="one_layer", architectures=("OneLayerForCausalLM",), model_cls=qwen3,
                    consumes_device_tokens=True, conformance_example=f"{HERE}:one_layer_example"),
        ModelFamily(name="flat", architectures=("FlatForCausalLM",), model_cls=qwen3,
                    consumes_device_tokens=True, conformance_example=f"{HERE}:flat_example"),
        ModelFamily(name="swapped_gate_up", architectures=("SwappedGateUpForCausalLM",),
                    model_cls=f"{HERE}:SwappedGateUp", consumes_device_tokens=True,
                    conformance_example=f"{HERE}:swapped_example"),
        ModelFamily(name="lossy_load", architectures=("LossyLoadForCausalLM",), model_cls=f"{HERE}:LossyLoad",
                    consumes_device_tokens=True, conformance_example=f"{HERE}:lossy_example"),
        *(ModelFamily(name=name, architectures=(f"{cls}ForCausalLM",), model_cls=f"{HERE}:{cls}",
                      consumes_device_tokens=True, conformance_example=f"{HERE}:{name}_example")
          for name, cls in (("ignores_norm_weight", "IgnoresNormWeight"), ("wrong_rope_theta", "WrongRopeTheta"),
                            ("prefill_ignores_cache", "PrefillIgnoresCache"),
                            ("cached_prefix_off_by_one", "CachedPrefixOffByOne"),
                            ("host_context_length", "HostContextLength"),
                            ("state_not_reset", "StateNotReset"),
                            ("snapshot_into_read_slot", "SnapshotIntoReadSlot"),
                            ("verify_state_only_at_end", "VerifyStateOnlyAtEnd"),
                            ("padding_into_state", "PaddingIntoState"), ("dead_tensor", "DeadTensor"),
                            ("unsharded_norm", "UnshardedNorm"), ("rank_zero_o_proj", "RankZeroOProj"),
                            ("fails_on_rank1", "FailsOnRank1"))),
        ModelFamily(name="dropped_bias", architectures=("DroppedBiasForCausalLM",),
                    model_cls="tests.fixture_async.qwen2:DroppedBias", consumes_device_tokens=True,
                    conformance_example="tests.fixture_async.qwen2:dropped_bias_example"),
        ModelFamily(name="wrong_model_type", architectures=("WrongModelTypeForCausalLM",), model_cls=qwen3,
                    consumes_device_tokens=True, conformance_example=f"{HERE}:wrong_model_type_example"),
    ]
