"""Checkpoint config (config.json, read without transformers) and the engine's knobs."""
from __future__ import annotations

import json
import os
from typing import Any

import attrs

from vtcore.errors import ConfigError, MissingConfigField
from vtcore.json_knobs import json_dict
from vtcore.spec.config import SpeculativeConfig

DEFAULT_MODEL = os.path.join(os.path.dirname(__file__), "default_model")


#: fields a decoder reads as sizes, checked where present (a family may name its sizes otherwise)
_POSITIVE_INTS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "intermediate_size", "max_position_embeddings", "moe_intermediate_size", "num_experts",
                  "num_experts_per_tok")


class HFConfig:
    """Attribute access over a config.json dict; ``text_config`` is flattened in when present."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.raw = dict(data)
        merged = dict(data)
        if isinstance(data.get("text_config"), dict):
            merged.update(data["text_config"])
            merged["architectures"] = data.get("architectures")
            if "tie_word_embeddings" in data:  # transformers ties a multimodal model by its top-level key
                merged["tie_word_embeddings"] = data["tie_word_embeddings"]
        self._data = merged

    @classmethod
    def from_path(cls, model: str) -> "HFConfig":
        path = os.path.join(model, "config.json")
        if not os.path.isfile(path):
            raise missing_checkpoint(model)
        try:
            with open(path) as f:
                return cls(json.load(f))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from exc

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["_data"][name]
        except KeyError:
            raise MissingConfigField(f"config.json has no field {name!r}, which the model needs") from None

    def validate(self) -> None:
        """Check the sizes and constants decoders read, where present, so a bad value is named here
        rather than failing deep inside a layer or torch (zero heads divided by zero, a negative
        vocabulary made a negative-size tensor, a negative rope_theta generated NaNs)."""
        data = self._data
        for name in _POSITIVE_INTS:
            value = data.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ConfigError(f"config.json: {name}={value!r}, expected a positive integer")
        heads, kv, hidden = data.get("num_attention_heads"), data.get("num_key_value_heads"), data.get("hidden_size")
        if heads and kv and heads % kv:
            raise ConfigError(f"config.json: num_key_value_heads={kv}, expected a divisor of "
                              f"num_attention_heads={heads}")
        if heads and hidden and data.get("head_dim") is None and hidden % heads:
            raise ConfigError(f"config.json: hidden_size={hidden} is not a multiple of num_attention_heads={heads} "
                              "and no head_dim is given")
        rope = data.get("rope_parameters") if isinstance(data.get("rope_parameters"), dict) else {}
        for name, value in (("rms_norm_eps", data.get("rms_norm_eps")),
                            ("rope_theta", rope.get("rope_theta", data.get("rope_theta")))):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not 0 < value < float("inf")):
                raise ConfigError(f"config.json: {name}={value!r}, expected a positive finite number")
        top_k, experts = data.get("num_experts_per_tok"), data.get("num_experts")
        if top_k is not None and experts is not None and top_k > experts:
            raise ConfigError(f"config.json: num_experts_per_tok={top_k}, expected at most num_experts={experts}")

    def get(self, name: str, default: Any = None) -> Any:
        return self._data.get(name, default)

    def to_dict(self) -> dict[str, Any]:
        return dict(self._data)

    @property
    def architecture(self) -> str:
        archs = self._data.get("architectures")
        if not archs or not isinstance(archs, list):
            raise ValueError(f"config.json: 'architectures' is {archs!r}, expected a list naming the model class")
        return archs[0]

    @property
    def head_dim(self) -> int:
        return self._data.get("head_dim") or self.hidden_size // self.num_attention_heads

    @property
    def rope_theta(self) -> float:
        params = self._data.get("rope_parameters") or {}
        return float(params.get("rope_theta", self._data.get("rope_theta", 10000.0)))

    @property
    def rope_parameters(self) -> dict[str, Any]:
        """HF's ``rope_parameters`` (transformers 5) or ``rope_scaling`` (4.x), or {} for plain RoPE."""
        return dict(self._data.get("rope_parameters") or self._data.get("rope_scaling") or {})

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self._data.get("eos_token_id")
        return [] if eos is None else list(eos) if isinstance(eos, list) else [eos]


def missing_checkpoint(model: str) -> FileNotFoundError:
    """The error for a ``model`` that names no checkpoint folder (and no hub id)."""
    return FileNotFoundError(f"model={model!r}: expected a checkpoint folder with config.json, found none")


#: the ``dtype`` names the engine takes ("auto": the checkpoint's on CUDA, float32 on CPU); each but
#: "auto" is a torch attribute name (torch.half is torch.float16)
DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")


def positive(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    """attrs validator: None or a positive int (a bool is not one)."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
        raise ValueError(f"{attribute.name}={value!r}: expected a positive integer")


def fraction(instance: Any, attribute: attrs.Attribute, value: float) -> None:
    """attrs validator: a number in (0, 1]."""
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{attribute.name}={value!r}: expected a fraction in (0, 1]")


def _seed(value: Any) -> int:
    """attrs converter: the engine's seed, an integer torch's generators take; None is 0 (vLLM's default)."""
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or not -2 ** 63 <= value < 2 ** 64:
        raise ValueError(f"seed={value!r}: expected an integer in [-2**63, 2**64) (or None for 0)")
    return value


def _dtype(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    name = value if isinstance(value, str) else str(value).removeprefix("torch.")  # torch.bfloat16 is fine too
    if name not in DTYPES:
        raise ValueError(f"{attribute.name}={value!r}: expected 'auto' or one of "
                         f"{sorted(d for d in DTYPES if d != 'auto')}")


def _max_logprobs(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    """attrs validator: an integer >= 0, or -1 (no cap)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < -1:
        raise ValueError(f"{attribute.name}={value!r}: expected an integer >= 0, or -1 for no cap")


def _bool(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and not isinstance(value, bool):  # "off" would read as true
        raise ValueError(f"{attribute.name}={value!r}: expected True or False"
                         + (" (or None: the family decides)" if attribute.name == "async_scheduling" else ""))


#: the scheduling policies (vLLM's ``scheduling_policy``)
SCHEDULING_POLICIES = ("fcfs", "priority")


def _policy(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value not in SCHEDULING_POLICIES:
        raise ValueError(f"{attribute.name}={value!r}: expected one of {list(SCHEDULING_POLICIES)}")


def _generation_config(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value not in ("auto", "vllm") and not (isinstance(value, str) and os.path.isfile(
            os.path.join(value, "generation_config.json"))):
        raise ValueError(f"{attribute.name}={value!r}: expected 'auto' (the checkpoint's generation_config.json "
                         "sampling defaults), 'vllm' (SamplingParams' own) or a folder holding a "
                         "generation_config.json")


#: generation_config.json keys that are SamplingParams defaults (vLLM reads the same), and their fields
GENERATION_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                       "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def _generation_override(value: "dict[str, Any] | str | None") -> "dict[str, Any] | None":
    """``override_generation_config`` from a dict (or its JSON text, as the flag takes it): generation_config.json
    keys of sampling defaults and their numbers; a bad key or value is refused naming it."""
    if value is None:
        return None
    value = json_dict("override_generation_config", value, '{"temperature": 0.5, "max_new_tokens": 256}')
    unknown = sorted(set(value) - set(GENERATION_SAMPLING))
    if unknown:
        raise ValueError(f"override_generation_config: unknown key(s) {unknown}; expected generation_config.json's "
                         f"sampling keys {sorted(GENERATION_SAMPLING)}")
    for key, v in value.items():
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise ValueError(f"override_generation_config: {key}={v!r}, expected a number (or null: no default)")
    return dict(value)


@attrs.frozen
class ProfilerConfig:
    """``profiler_config`` (vLLM's name and keys): ``profiler`` "torch" (``torch.profiler``, the one this engine
    has) and ``torch_profiler_dir``, the folder ``stop_profile`` writes each trace to."""

    profiler: str
    torch_profiler_dir: str

    @classmethod
    def parse(cls, value: "ProfilerConfig | dict[str, Any] | str | None") -> "ProfilerConfig | None":
        """From a dict (or its JSON text, as ``--profiler-config`` takes it); None stays None. A bad key or value
        is refused naming it and what is expected."""
        if value is None or isinstance(value, ProfilerConfig):
            return value
        value = json_dict("profiler_config", value, '{"profiler": "torch", "torch_profiler_dir": "/tmp/traces"}')
        known = {f.name for f in attrs.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"profiler_config: unknown key(s) {unknown}; expected {sorted(known)}")
        if value.get("profiler") != "torch":
            raise ValueError(f"profiler_config: profiler={value.get('profiler')!r}, expected 'torch'")
        folder = value.get("torch_profiler_dir")
        if not isinstance(folder, str) or not folder:
            raise ValueError(f"profiler_config: torch_profiler_dir={folder!r}, expected the folder traces go to")
        return cls(profiler="torch", torch_profiler_dir=folder)


@attrs.define(kw_only=True)
class EngineConfig:
    """The engine's knobs (vLLM's names). ``None`` means "derive from the checkpoint or device".

    Each field's metadata describes it for the command line (``vtcore.engine.arg_utils`` makes one flag
    a field from it): ``help``; ``default_help``, what the default means where the value alone does
    not say; ``choices``; ``flag=False`` for a field with no flag.
    """

    model: str = attrs.field(default=DEFAULT_MODEL, metadata={
        "help": "the checkpoint: a folder, or a Hugging Face hub id (found in, or downloaded to, "
                "huggingface_hub's cache)", "default_help": "the embedded default model"})
    tokenizer: str | None = attrs.field(default=None, metadata={
        "help": "the tokenizer's folder or hub id", "default_help": "the model's"})
    device: str | None = attrs.field(default=None, metadata={
        "help": "cpu, cuda or cuda:N", "default_help": "cuda when available, else cpu"})
    dtype: str = attrs.field(default="auto", validator=_dtype, metadata={
        "help": "the weights' and activations' dtype; auto: the checkpoint's on CUDA (float32 promoted to "
                "bfloat16), float32 on CPU", "choices": DTYPES})
    load_format: str = attrs.field(default="auto", metadata={
        "help": "the weight loader: auto (the checkpoint's safetensors), dummy (random weights from "
                "config.json), or one a plugin registers"})
    seed: int = attrs.field(default=0, converter=_seed, metadata={
        "help": "the engine's random seed (requests without their own seed sample from it; dummy weights)"})
    max_model_len: int | None = attrs.field(default=None, validator=positive, metadata={
        "help": "the longest sequence, prompt and output, in tokens",
        "default_help": "the checkpoint's max_position_embeddings"})
    max_num_seqs: int = attrs.field(default=256, validator=positive, metadata={
        "help": "the most sequences in one step, and the largest padded decode batch (one CUDA graph each)"})
    scheduling_policy: str = attrs.field(default="fcfs", validator=_policy, metadata={
        "help": "fcfs: requests are served in arrival order; priority: by each request's priority (lower first, "
                "then arrival), and the KV pool running short preempts the lowest-priority running request",
        "choices": SCHEDULING_POLICIES})
    tensor_parallel_size: int = attrs.field(default=1, validator=positive, metadata={
        "help": "ranks the model is split over (tensor parallelism, one process each: this one is rank 0; "
                "gloo on CPU, NCCL on CUDA)", "short": "-tp"})
    max_num_batched_tokens: int | None = attrs.field(default=None, validator=positive, metadata={
        "help": "the most tokens in one step (prefill chunks included)",
        "default_help": "max(max_model_len, 2048)"})
    block_size: int = attrs.field(default=16, validator=positive, metadata={"help": "tokens per KV-cache block"})
    num_kv_blocks: int | None = attrs.field(default=None, validator=positive, metadata={
        "help": "KV-cache blocks", "default_help": "what --gpu-memory-utilization leaves on CUDA, 1 GiB on CPU"})
    gpu_memory_utilization: float = attrs.field(default=0.9, validator=fraction, metadata={
        "help": "the fraction of GPU memory the engine may use, KV cache included"})
    enable_prefix_caching: bool = attrs.field(default=True, validator=_bool, metadata={
        "help": "reuse the KV of cached full blocks a prompt shares with earlier requests (hash-based; "
                "families with per-request state resume from state snapshots, see --state-snapshot-interval)"})
    state_snapshot_interval: int | None = attrs.field(default=None, validator=positive, metadata={
        "help": "prefix caching of families with per-request state (hybrid models): tokens between the "
                "state snapshots a prompt leaves (a cached prefix resumes from the last one it covers); "
                "a multiple of --block-size", "default_help": "512 tokens (rounded to whole blocks)"})
    num_state_snapshots: int | None = attrs.field(default=None, validator=positive, metadata={
        "help": "state snapshot slots for prefix caching of families with per-request state",
        "default_help": "what a tenth of the cache memory holds, at most one per interval of every running "
                        "request's longest context"})
    speculative_config: SpeculativeConfig | None = attrs.field(
        default=None, converter=SpeculativeConfig.parse, metadata={
            "help": 'speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": K} (prompt '
                    "lookup over the request's own tokens; prompt_lookup_min / prompt_lookup_max: the n-gram "
                    'lengths), {"method": "draft_model", "model": PATH, "num_speculative_tokens": K} (a '
                    'registered family of the same vocabulary proposes) or {"method": "mtp", '
                    '"num_speculative_tokens": K} (the checkpoint\'s own MTP head)', "default_help": "off",
            "metavar": "JSON"})
    profiler_config: ProfilerConfig | None = attrs.field(
        default=None, converter=ProfilerConfig.parse, metadata={
            "help": 'torch.profiler traces of the steps between start_profile and stop_profile (LLM, AsyncLLM, and '
                    'the server\'s POST /start_profile and /stop_profile), as JSON: {"profiler": "torch", '
                    '"torch_profiler_dir": DIR}', "default_help": "off", "metavar": "JSON"})
    enforce_eager: bool = attrs.field(default=False, validator=_bool, metadata={
        "help": "run every step eagerly, without CUDA graphs (decode, verify and lone prefill-chunk steps)"})
    async_scheduling: bool | None = attrs.field(default=None, validator=_bool, metadata={
        "help": "prepare and submit step N+1 before step N's tokens are back",
        "default_help": "on for model families that consume device token ids"})
    async_device_mirror: bool | None = attrs.field(default=None, validator=_bool, metadata={
        "flag": False, "help": "async scheduling with the device mirror (two steps in flight), or the rollback "
                               "(False: the host waits for each step's tokens); None reads "
                               "VTCORE_ASYNC_DEVICE_MIRROR (default 1: on)"})
    max_logprobs: int = attrs.field(default=20, validator=_max_logprobs, metadata={
        "help": "the most alternatives a request's logprobs or prompt_logprobs may ask for (-1 in a request asks "
                "for the whole vocabulary); -1: no cap (vLLM's flag and default)"})
    trust_remote_code: bool = attrs.field(default=False, validator=_bool, metadata={
        "help": "let the tokenizer run code its checkpoint ships (transformers' trust_remote_code; the model "
                "itself is always a registered family's own code)"})
    generation_config: str = attrs.field(default="auto", validator=_generation_config, metadata={
        "help": "auto: the sampling values of the checkpoint's generation_config.json are the defaults of "
                "requests that leave them unset (vLLM's default); vllm: SamplingParams' own; a folder: the "
                "generation_config.json there instead of the checkpoint's"})
    override_generation_config: dict[str, Any] | None = attrs.field(
        default=None, converter=_generation_override, metadata={
            "help": "sampling defaults set over generation_config's, as JSON of generation_config.json keys: "
                    '{"temperature": 0.5, "max_new_tokens": 256} (with generation_config vllm, the only defaults '
                    "besides SamplingParams' own)", "default_help": "none", "metavar": "JSON"})
