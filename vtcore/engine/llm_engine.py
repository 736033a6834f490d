"""The sync engine: one step in flight. Schedule, run, sample, then apply the tokens on the host."""
from __future__ import annotations

import itertools
import json
import logging
import os
import time
from collections import deque
from functools import partial
from typing import Any

import attrs
import torch

from vtcore.config import DTYPES, GENERATION_SAMPLING, EngineConfig, HFConfig
from vtcore.engine.block_pool import BlockPool
from vtcore.engine.compile_watch import watch_triton_compiles
from vtcore.engine.detokenizer import IncrementalDetokenizer
from vtcore.engine.front_end_text import text_in_front_end
from vtcore.engine.capacity import EngineLimits, EngineStats
from vtcore.engine.profiler import StepProfiler
from vtcore.engine.prompt_text import Prompt, PromptText, prompt_cache_salt
from vtcore.engine.request import Request
from vtcore.engine.scheduler import Scheduler
from vtcore.engine.snapshot_pool import SnapshotPool
from vtcore.engine.tokenizer import engine_tokenizer
from vtcore.engine.warm_up import warm_up
from vtcore.errors import ConfigError, RequestRejected, VtcoreError
from vtcore.loading.hub import resolve_model
from vtcore.layers.parallel import tensor_parallel
from vtcore.loading.model_loader import build_model, quant_format
from vtcore.plugins.manager import get_plugins
from vtcore.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from vtcore.sampling_params import RequestOutputKind, SamplingParams, as_int
from vtcore.engine.scheduler import Batch, Scheduled
from vtcore.spec.draft_model import DraftModelProposer
from vtcore.spec.ngram import NgramProposer
from vtcore.spec.proposer import Proposer
from vtcore.spec.stats import SpecDecodeStats
from vtcore.worker.bad_words import bad_words_token_ids
from vtcore.worker.model_runner import ModelRunner, RunnerConfig, StepHandle
from vtcore.worker.mtp import build_draft_head
from vtcore.worker.step import DEVICE_DRAFT, StepOutput
from vtcore.worker.tensor_parallel import Peers, WorkerSetup

log = logging.getLogger("vtcore")

_SAID_NO_CACHING: set[tuple[str, tuple[str, ...]]] = set()  # (family, layers unable to snapshot) logged once
#: tokens between state snapshots when state_snapshot_interval is not given (rounded to whole blocks)
DEFAULT_SNAPSHOT_INTERVAL = 512


def _cache_salt(dtype: torch.dtype, hf: HFConfig) -> bytes:
    """What besides the tokens makes a block's KV: the dtype and the quant format (the prefix cache's salt)."""
    quant = hf.get("quantization_config")
    return f"{dtype}|{quant_format(quant) if quant else ''}".encode()


_DTYPES = {name: getattr(torch, name) for name in DTYPES if name != "auto"}  # torch.half is torch.float16

def resolve_device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device={device!r}: expected 'cpu', 'cuda' or 'cuda:N'") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: expected 'cpu', 'cuda' or 'cuda:N'")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: CUDA is not available on this machine; use device='cpu'")
    return dev


def resolve_dtype(dtype: str | torch.dtype, hf_config: HFConfig, device: torch.device) -> torch.dtype:
    """``dtype`` (a name of ``DTYPES``, as EngineConfig checked, or a torch dtype) as a torch dtype;
    ``auto``: the checkpoint's dtype on CUDA (float32 promoted to bfloat16), float32 on CPU."""
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        stored = hf_config.get("torch_dtype") or hf_config.get("dtype") or "bfloat16"
        return torch.bfloat16 if stored == "float32" else _DTYPES.get(stored, torch.bfloat16)
    return _DTYPES[dtype]


def drafts_on_device(config: EngineConfig) -> bool:
    """Whether speculative decoding drafts on the device: an MTP head always; the n-gram proposer and a
    draft model when async scheduling is asked for (``vtcore.worker.ngram``, ``vtcore.worker.mtp``;
    without it the host's n-gram proposes, a miss proposing nothing, and the draft model runs as an engine
    of its own, ``vtcore.spec.draft_model``)."""
    spec = config.speculative_config
    return spec is not None and (spec.method == "mtp" or bool(config.async_scheduling))


def async_depth(config: EngineConfig, family_name: str, consumes_device_tokens: bool) -> int:
    """How many steps may be in flight: 2 with async scheduling and the device mirror on, else 1."""
    if config.async_scheduling and not consumes_device_tokens:
        raise VtcoreError(f"async_scheduling=True: model family {family_name!r} does not declare that it "
                          "consumes device token ids (ModelFamily.consumes_device_tokens), so its forward "
                          "could embed host placeholders; use async_scheduling=False or fix the family")
    spec = config.speculative_config
    if spec is not None and drafts_on_device(config) and not consumes_device_tokens:
        raise VtcoreError(f"speculative_config method {spec.method!r}: model family {family_name!r} does not declare "
                          "that it consumes device token ids (ModelFamily.consumes_device_tokens), and drafts and "
                          "accepted tokens made on the device are fed from there")
    if spec is not None and not drafts_on_device(config):  # a host proposer needs each step's tokens on the host
        if config.async_scheduling:
            raise VtcoreError(f"async_scheduling=True with speculative_config method {spec.method!r}: that "
                              "proposer reads each request's tokens on the host, so the host waits for every "
                              "step; use async_scheduling=False or leave it unset")
        log.info("vtcore: async scheduling off: the %s proposer reads tokens on the host", spec.method)
        return 1
    enabled = consumes_device_tokens if config.async_scheduling is None else config.async_scheduling
    if config.async_scheduling is None and not consumes_device_tokens:
        log.info("vtcore: async scheduling off: family %r does not consume device token ids", family_name)
    if not enabled:
        return 1
    mirror = config.async_device_mirror
    if mirror is None:
        env = os.environ.get("VTCORE_ASYNC_DEVICE_MIRROR", "1")
        if env not in ("0", "1"):
            raise ValueError(f"VTCORE_ASYNC_DEVICE_MIRROR={env!r}: expected 1 (default) or 0 (rollback)")
        mirror = env == "1"
    return 2 if mirror else 1


@attrs.define
class _Fanout:
    """An ``n > 1`` request: its samples (one child request each, in index order), the kind of output
    it wants and each sample's last completion."""

    children: list[Request]
    kind: RequestOutputKind
    latest: list[CompletionOutput | None] = attrs.field()

    @latest.default
    def _none(self) -> list[CompletionOutput | None]:
        return [None] * len(self.children)


class LLMEngine(PromptText):
    """Owns the scheduler, the runner and the requests; ``step`` advances every running request.

    Sync and async differ only in ``depth``, the number of steps in flight: at depth 2, ``step``
    schedules and submits step N+1 before it waits for step N's tokens.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        #: the checkpoint folder: ``config.model`` itself, or a hub id's snapshot in huggingface_hub's cache
        self.model_path = resolve_model(config.model, weights=config.load_format != "dummy")
        self.hf_config = HFConfig.from_path(self.model_path)
        self.hf_config.validate()
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.hf_config, self.device)
        hf = self.hf_config
        trained = hf.get("max_position_embeddings")
        if config.max_model_len and trained is not None and config.max_model_len > int(trained):
            raise ConfigError(f"max_model_len={config.max_model_len} exceeds the model's max_position_embeddings="
                              f"{trained} ({os.path.join(self.model_path, 'config.json')}): positions past it were "
                              f"never trained and no RoPE scaling here extends them; pass max_model_len <= {trained}")
        self.max_model_len = config.max_model_len or int(4096 if trained is None else trained)
        self.max_num_batched_tokens = config.max_num_batched_tokens or max(self.max_model_len, 2048)
        self.vocab_size = int(hf.vocab_size)
        self.tokenizer = engine_tokenizer(config, self.model_path)
        gen = self._generation_config()  # read once: the server asks for its defaults every request
        self.eos_token_ids = self._eos_ids(gen)
        # the model's own end of text: the tokenizer's (else config.json's); stopping on another EOS id (one the
        # generation config adds) names it as its stop_reason, as vLLM's stop_token_ids do
        own = None if self.tokenizer is None else self.tokenizer.eos_token_id
        self._own_eos = set(hf.eos_token_ids) if own is None else {own}
        override = config.override_generation_config or {}
        try:
            SamplingParams(**{GENERATION_SAMPLING[key]: v for key, v in override.items() if v is not None})
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"override_generation_config={override}: {exc}") from None
        # (vLLM's merge: the override's keys over the file's, a null dropping that default)
        merged = {**({} if config.generation_config == "vllm" else gen), **override}
        self._sampling_defaults = {field: merged[key] for key, field in GENERATION_SAMPLING.items()
                                   if merged.get(key) is not None}
        try:
            SamplingParams(**self._sampling_defaults)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{self._generation_config_path()}: {exc} (or pass generation_config='vllm' to "
                              "ignore its sampling values, or override_generation_config to set this one)") from None
        spec = config.speculative_config
        mtp = spec is not None and spec.method == "mtp"
        on_device = spec.method if drafts_on_device(config) else None
        ngram = (spec.prompt_lookup_min, spec.prompt_lookup_max) if on_device == "ngram" else None
        draft_path = self._device_draft_path() if on_device == "draft_model" else None
        ranks = config.tensor_parallel_size
        proposer = self._proposer()
        peers = Peers(ranks, self.device) if ranks > 1 else None
        try:
            with tensor_parallel(0, ranks, None if peers is None else peers.group):
                model, self.family = build_model(self.model_path, hf, self.device, self.dtype, self.max_model_len,
                                                 config.load_format, config.seed, mtp=mtp)
                if draft_path is not None:
                    model.mtp = build_draft_head(draft_path, self.device, self.dtype, self.max_model_len,
                                                 config.load_format, config.seed)
                self.depth = async_depth(config, self.family.name, self.family.consumes_device_tokens)
                self.runner = ModelRunner(model, self.family, RunnerConfig(
                    self.vocab_size, self.device, self.dtype, config.block_size, config.num_kv_blocks,
                    config.gpu_memory_utilization, self.max_model_len, config.max_num_seqs, self.eos_token_ids,
                    config.seed, self.depth, config.enforce_eager, config.enable_prefix_caching,
                    config.num_state_snapshots, self._snapshot_interval(),
                    config.speculative_config.num_speculative_tokens if config.speculative_config else 0,
                    self.max_num_batched_tokens, on_device in ("mtp", "draft_model"), ranks, ngram))
            if peers is not None:
                # rank 0's cache sizes, not each rank's own reading of its free memory: the block ids and state
                # slots rank 0 hands out must exist on every rank
                sized = attrs.evolve(self.runner.config, num_kv_blocks=self.runner.num_kv_blocks,
                                     num_state_snapshots=self.runner.num_state_snapshots)
                peers.setup(WorkerSetup(self.model_path, self.dtype, self.max_model_len, config.load_format,
                                        config.seed, sized, get_plugins().entry_points, draft_path))
                peers.ready()  # every rank's model and runner built (a worker that failed is named)
                self.runner.peers = peers
                self.runner.capture_graphs()  # the ranks capture together
        except BaseException:
            if peers is not None:
                peers.shutdown()
            raise
        self.inflight: deque[tuple[Batch, StepHandle]] = deque()
        self._tokens_ts = 0.0  # when the latest step's tokens reached the host (time.monotonic)
        self.fanouts: dict[str, _Fanout] = {}  # n > 1 requests by their id
        self._sample_of: dict[str, tuple[str, int]] = {}  # an n > 1 request's sample id -> (its id, index)
        self.event_log: list[tuple[str, int]] | None = None  # set to [] to record schedule/prepare/wait
        caching, snapshots = self._prefix_caching()
        self.pool = BlockPool(self.runner.num_kv_blocks, config.block_size, caching, _cache_salt(self.dtype, hf))
        self.scheduler = Scheduler(self.pool, config.max_num_seqs, self.max_num_batched_tokens, self.max_model_len,
                                   snapshots, proposer, spec.num_speculative_tokens if spec else 0,
                                   device_drafts=drafts_on_device(config), lookahead=self.runner.lookahead,
                                   by_priority=config.scheduling_policy == "priority")
        self.spec_stats = SpecDecodeStats(spec.num_speculative_tokens if spec else 0)
        self.profiler = StepProfiler(config.profiler_config, self.device)
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        #: an engine core process's: requests without stop strings get no text here (``front_end_text``)
        self.front_end_text = False
        if self.device.type == "cuda":
            try:
                warm_up(self)  # the kernel variants a served load needs, compiled before its first request
            except BaseException:
                self.shutdown()  # tensor-parallel workers and a draft engine too: nothing outlives a failed build
                raise
            watch_triton_compiles()

    def _proposer(self) -> Proposer | None:
        """The proposer ``speculative_config`` names (None: no speculative decoding, or a method drafting on
        the device in the runner: ``drafts_on_device``). A draft model is built before the target's KV cache is
        sized: its own cache (at most its max_num_seqs full contexts) comes out of the same memory budget."""
        spec = self.config.speculative_config
        if spec is None or drafts_on_device(self.config):
            return None
        if spec.method == "ngram":
            return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        c = self.config
        draft = LLMEngine(attrs.evolve(c, model=spec.model, tokenizer=None, speculative_config=None,
                                       async_scheduling=False, enable_prefix_caching=True,
                                       max_model_len=self.max_model_len, num_kv_blocks=None,
                                       num_state_snapshots=None, tensor_parallel_size=1))
        self._refuse_other_vocabulary(draft.vocab_size)
        return DraftModelProposer(draft)

    def _refuse_other_vocabulary(self, draft_vocab_size: int) -> None:
        if draft_vocab_size != self.vocab_size:
            raise ConfigError(f"speculative_config: the draft model {self.config.speculative_config.model!r} has "
                              f"vocab_size={draft_vocab_size}, the target {self.config.model!r} {self.vocab_size}: "
                              "a draft must share the target's vocabulary")

    def _device_draft_path(self) -> str:
        """The checkpoint folder of ``speculative_config``'s draft model, checked for drafting on the device
        (``build_draft_head`` builds it on every rank)."""
        c, spec = self.config, self.config.speculative_config
        path = resolve_model(spec.model, weights=c.load_format != "dummy")
        hf = HFConfig.from_path(path)
        hf.validate()
        self._refuse_other_vocabulary(int(hf.vocab_size))
        return path

    def _snapshot_interval(self) -> int:
        """Tokens between state snapshots: ``state_snapshot_interval``, or the default in whole blocks."""
        config = self.config
        interval = config.state_snapshot_interval or max(1, DEFAULT_SNAPSHOT_INTERVAL // config.block_size) \
            * config.block_size
        if interval % config.block_size:
            raise ConfigError(f"state_snapshot_interval={interval}: expected a multiple of block_size="
                              f"{config.block_size} (a snapshot ends a cached block)")
        return interval

    def _prefix_caching(self) -> tuple[bool, SnapshotPool | None]:
        """``enable_prefix_caching``, and for a family with stateful layers the pool of their state
        snapshots; caching is off (said once) when such a layer cannot snapshot or no snapshot fits."""
        config = self.config
        if not config.enable_prefix_caching:
            return False, None
        stateful = self.runner.stateful_layers
        if not stateful:
            return True, None
        if self.runner.num_state_snapshots:
            return True, SnapshotPool(self.runner.num_state_snapshots, self.runner.config.state_snapshot_interval)
        unable = sorted({type(m).__name__ for m in stateful if not m.supports_state_snapshots})
        key = (self.family.name, tuple(unable))
        if key not in _SAID_NO_CACHING:
            _SAID_NO_CACHING.add(key)
            why = (f"its layers {unable} keep per-request state and cannot snapshot it "
                   "(StatefulLayer.supports_state_snapshots)") if unable else \
                "no state snapshot fits in the memory left for the caches"
            log.warning("vtcore: prefix caching is off for model family %r: %s", self.family.name, why)
        return False, None

    def _generation_config_path(self) -> str:
        """generation_config.json of the checkpoint, or of the folder ``generation_config`` names."""
        folder = self.config.generation_config
        return os.path.join(self.model_path if folder in ("auto", "vllm") else folder, "generation_config.json")

    def _generation_config(self) -> dict[str, Any]:
        path = self._generation_config_path()
        if not os.path.isfile(path):
            return {}
        with open(path) as f:
            return json.load(f)

    def default_sampling(self) -> dict[str, Any]:
        """SamplingParams fields the checkpoint's generation_config.json sets (vLLM reads the same
        keys; ``max_new_tokens`` is ``max_tokens``), or none with ``generation_config="vllm"``; then
        ``override_generation_config``'s over them."""
        return dict(self._sampling_defaults)

    def _eos_ids(self, gen: dict[str, Any]) -> list[int]:
        ids = self.hf_config.eos_token_ids
        eos = gen.get("eos_token_id")
        if eos is not None:
            ids += eos if isinstance(eos, list) else [eos]
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return sorted(set(ids))

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams, priority: int = 0) -> None:
        """Validate and queue a request; a bad one raises here and leaves the others untouched. ``priority``
        (vLLM's): under ``scheduling_policy="priority"``, lower values are scheduled first; otherwise only 0.

        ``params.n > 1`` runs ``n`` samples of the prompt as requests ``"{i}_{request_id}"`` (seed ``seed
        + i`` when seeded, prompt logprobs in sample 0 only), reported under ``request_id`` with the
        completions' ``index`` = i (vLLM's parallel sampling; see :meth:`step`)."""
        if self._in_use(request_id):
            raise ValueError(f"request_id={request_id!r}: already in use by an unfinished request")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params={params!r}: expected a SamplingParams")
        priority = self._check_priority(priority)
        salt = prompt_cache_salt(prompt)
        text, ids = self.tokenize(prompt)
        kept = params.truncated(ids, self.max_model_len)
        if len(kept) < len(ids):  # the text no longer spells the prompt the request runs on
            text, ids = None, kept
        if params.n == 1:
            self._add(request_id, text, ids, params, salt, priority)
            return
        children: list[Request] = []
        try:
            for i in range(params.n):
                child = f"{i}_{request_id}"
                if self._in_use(child):
                    raise ValueError(f"request_id={request_id!r}: its sample {i}'s id {child!r} is already in use "
                                     "by an unfinished request")
                sample = params.sample(i)
                children.append(self._add(child, text, ids, sample if i == 0 else attrs.evolve(sample,
                                                                                          prompt_logprobs=None),
                                          salt, priority))
        except Exception:
            for c in children:
                self.drop_request(c.request_id)
            raise
        self.fanouts[request_id] = _Fanout(children, params.output_kind)
        for i, c in enumerate(children):
            self._sample_of[c.request_id] = (request_id, i)

    def _add(self, request_id: str, text: str | None, ids: list[int], params: SamplingParams,
             cache_salt: str | None = None, priority: int = 0) -> Request:
        if not ids:
            raise RequestRejected(f"request {request_id!r}: the prompt is empty; expected at least one token")
        params.check_vocab(self.vocab_size, self.config.max_logprobs)
        params = params.for_vocab(self.vocab_size)
        req = Request(request_id, ids, params, self.max_model_len, next(self._arrivals), text)
        req.cache_salt, req.priority = cache_salt, priority
        if params.seed is not None:
            req.generator = torch.Generator(device=self.device).manual_seed(params.seed)
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError(f"SamplingParams.bad_words={params.bad_words!r}: the model has no tokenizer to "
                                 "spell them with; expected no bad_words")
            req.bad_words = bad_words_token_ids(partial(self.tokenizer.encode, add_special_tokens=False),
                                                params.bad_words, self.vocab_size)
        if params.structured_outputs is not None:
            req.grammar = self._grammars().matcher(params.structured_outputs)
        if self.tokenizer is not None and params.detokenize and not (
                self.front_end_text and text_in_front_end(params)):
            req.detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens, params.stop,
                                               params.include_stop_str_in_output)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]
        self.scheduler.add(req)
        self.requests[request_id] = req
        if req.max_output == 0 and params.prompt_logprobs is None:
            self.scheduler.finish(req, "length")
        return req

    def _check_priority(self, priority: Any) -> int:
        """``priority`` as an int (an integer of another type, numpy's, taken as its int), or a ValueError."""
        priority = as_int(priority)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority={priority!r}: expected an integer")
        if priority and not self.scheduler.by_priority:
            raise ValueError(f"priority={priority}: this engine's scheduling_policy is "
                             f"{self.config.scheduling_policy!r}; a priority other than 0 needs "
                             "scheduling_policy='priority'")
        return priority

    def _in_use(self, request_id: str) -> bool:
        return request_id in self.requests or request_id in self.fanouts

    def _members(self, request_id: str) -> list[Request]:
        """The engine requests behind an id: an ``n > 1`` request's samples, else the one (if any)."""
        fan = self.fanouts.get(request_id)
        if fan is not None:
            return fan.children
        req = self.requests.get(request_id)
        return [] if req is None else [req]

    def abort_request(self, request_id: str) -> None:
        """Abort a request (every sample of an ``n > 1`` one); it reports ``finish_reason="abort"``."""
        for req in self._members(request_id):
            if not req.is_finished:
                self.scheduler.finish(req, "abort")

    def drop_request(self, request_id: str) -> None:
        """Abort a request and forget it: no output will report it."""
        members = self._members(request_id)
        self.abort_request(request_id)
        self.fanouts.pop(request_id, None)
        for req in members:
            self.requests.pop(req.request_id, None)
            self._sample_of.pop(req.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.inflight) or any(
            r.is_finished for r in self.requests.values())

    # ------------------------------------------------------------------ stepping
    def _log(self, event: str, step: int) -> None:
        if self.event_log is not None:
            self.event_log.append((event, step))

    def step(self) -> list[RequestOutput]:
        """Schedule and submit one step; then, once ``depth`` steps are in flight (or nothing more can be
        scheduled), wait for the oldest and apply its tokens. Returns the outputs that changed."""
        touched = [r for r in self.requests.values() if r.is_finished]  # aborted, or max_tokens=0
        batch = self.scheduler.schedule()
        if batch:
            step = self.runner.steps_submitted
            self._log("schedule", step)
            try:
                self.inflight.append((batch, self.runner.submit(batch)))
            except BaseException:
                self._give_up(batch)
                raise
            self._log("prepare", step)
        self.scheduler.register_computed()  # (after the submit: the device need not wait for the block hashes)
        if self.inflight and (len(self.inflight) >= self.depth or not batch):
            done, handle = self.inflight.popleft()
            self._log("wait", handle.step)
            try:
                result = handle.result()
            except BaseException:
                self._give_up(done)
                raise
            row = 0
            self._tokens_ts = time.monotonic()  # (once a step: when its tokens reached the host)
            drafts, accepted = iter(result.drafts or ()), iter(result.accepted or ())
            for s in done:
                counted = next(accepted) if s.samples and result.accepted is not None else None
                if s.draft:
                    self._apply_verified(s, result, row, counted)
                elif s.samples:
                    self._apply(s.request, result, row)
                if s.samples and result.drafts is not None:
                    s.request.proposed = next(drafts)
                row += s.num_sampled
            for _, later in self.inflight:  # their late rows' masks may exist now
                later.draw_late()
            for s in done:
                if s.request.prompt_logprobs is not None and s.request.request_id in result.prompt_logprobs:
                    s.request.prompt_logprobs.extend(
                        {t: Logprob(lp, rank, self._piece(t, s.request.params)) for t, (lp, rank) in pos.items()}
                        for pos in result.prompt_logprobs[s.request.request_id])
            touched += [s.request for s in done]
        outputs: list[RequestOutput] = []
        samples: dict[str, list[tuple[int, RequestOutput | None]]] = {}  # n > 1: parent -> its samples' outputs
        # A request that stopped while a later step was in flight was reported already: skip it.
        for r in (r for r in dict.fromkeys(touched) if self.requests.get(r.request_id) is r):
            out = self._output(r)
            parent = self._sample_of.get(r.request_id)
            if parent is not None:
                samples.setdefault(parent[0], []).append((parent[1], out))
            elif out is not None:
                outputs.append(out)
            if r.is_finished:
                self.requests.pop(r.request_id, None)
        for parent, changed in samples.items():
            out = self._fanout_output(parent, changed)
            if out is not None:
                outputs.append(out)
        return outputs

    def _fanout_output(self, parent: str, changed: list[tuple[int, RequestOutput | None]]) -> RequestOutput | None:
        """An ``n > 1`` request's output from its samples' outputs of this step: streamed (cumulative or
        delta), the completions that changed, each with its ``index``; final-only, all ``n`` once all have
        finished (as vLLM's parallel sampling reports them). ``finished`` once every sample has."""
        fan = self.fanouts[parent]
        for i, out in changed:
            if out is not None:
                fan.latest[i] = attrs.evolve(out.outputs[0], index=i)
        finished = all(c.is_finished for c in fan.children)
        if fan.kind == RequestOutputKind.FINAL_ONLY:
            completions = list(fan.latest) if finished else []
        else:
            completions = [fan.latest[i] for i, out in sorted(changed) if out is not None]
        if finished:
            del self.fanouts[parent]
            for c in fan.children:
                self._sample_of.pop(c.request_id, None)
        if not completions:
            return None
        first = fan.children[0]
        plp = first.prompt_logprobs  # (sample 0's; in a DELTA stream its own output's, which carries them once)
        if fan.kind == RequestOutputKind.DELTA:
            plp = next((o.prompt_logprobs for i, o in changed if i == 0 and o is not None), None)
        return RequestOutput(parent, first.prompt, first.prompt_token_ids, plp, completions,
                             finished, first.num_cached_tokens,
                             RequestMetrics(sum(c.num_draft_tokens for c in fan.children),
                                            sum(c.num_accepted_tokens for c in fan.children),
                                            first.queued_ts, min((c.scheduled_ts for c in fan.children
                                                                  if c.scheduled_ts), default=0.0),
                                            min((c.first_token_ts for c in fan.children if c.first_token_ts),
                                                default=0.0), max(c.last_token_ts for c in fan.children)))

    def _give_up(self, batch: Batch) -> None:
        """A step failed: abort its requests and those of every step still in flight (which read its
        tokens), so the engine is left consistent and serves the next request (the caller sees the
        error; the aborted requests report ``finish_reason="abort"`` on the next step)."""
        batches = [batch]
        while self.inflight:
            later, handle = self.inflight.popleft()
            handle.discard()
            batches.append(later)
        for b in batches:
            for s in b:
                if not s.request.is_finished:
                    self.scheduler.finish(s.request, "abort")

    def _apply_verified(self, s: Scheduled, result: StepOutput, row: int, accepted: int | None) -> None:
        """Apply a verify row: the token sampled after the fed one, then after each draft token while the
        token sampled before it equals it (each sampled token is drawn from the target's distribution
        given the tokens before it, so accepting a proposal exactly when the draw equals it keeps that
        distribution); ``accepted``: that count as the device found it, taken for drafts made there. The
        scheduler settles the count (``Verify``); the KV of rejected draft positions is left to be
        overwritten. Tokens past a stop are dropped."""
        req, draft = s.request, s.draft
        if draft[0] != DEVICE_DRAFT:  # the host's own proposals: counted here
            accepted = 0
            while accepted < len(draft) and result.token_ids[row + accepted] == draft[accepted]:
                accepted += 1
        s.verify.accepted = accepted
        for i in range(accepted + 1):
            self._apply(req, result, row + i, inflight=i == 0)
        req.num_draft_tokens += len(draft)
        req.num_accepted_tokens += accepted
        self.spec_stats.record(len(draft), accepted)

    def _apply(self, req: Request, result: StepOutput, row: int, inflight: bool = True) -> None:
        """Apply one sampled token on the host: append, logprobs, text, stops."""
        if req.is_finished:
            return  # stopped (or aborted) while this step was in flight: its token is dropped
        req.num_inflight -= inflight
        token = result.token_ids[row]
        outputs = req.num_output_tokens
        if outputs >= req.max_output:  # max_tokens=0: only prompt logprobs were wanted
            self.scheduler.finish(req, "length")
            return
        req.token_ids.append(token)
        if outputs == 0:
            req.first_token_ts = self._tokens_ts
        req.last_token_ts = self._tokens_ts
        outputs += 1
        p = req.params
        if req.logprobs is not None:
            r = result
            entry = {token: Logprob(r.logprobs[row], r.ranks[row], self._piece(token, p))}
            for rank, (tid, lp) in enumerate(zip(r.top_ids[row][:p.logprobs], r.top_logprobs[row][:p.logprobs]), 1):
                entry.setdefault(tid, Logprob(lp, rank, self._piece(tid, p)))
            req.logprobs.append(entry)
            req.cumulative_logprob += r.logprobs[row]
        past_min = outputs > p.min_tokens
        eos = not p.ignore_eos and token in self.eos_token_ids and past_min
        stop_token = past_min and token in p.stop_token_ids
        # a stopping token's text is not in the output unless include_stop_str_in_output (vLLM's detokenizer), and
        # it stops the request before any stop string its text would complete (stop_reason: the token)
        feeds_text = req.detok is not None and not ((eos or stop_token) and not p.include_stop_str_in_output)
        stop_str = req.detok.add(token, check_stop=past_min) if feeds_text else None
        if eos or stop_token:
            req.stop_reason = None if eos and token in self._own_eos else token
            self.scheduler.finish(req, "stop")
        elif stop_str is not None:
            req.stop_reason = stop_str
            self.scheduler.finish(req, "stop")
        elif outputs >= req.max_output:
            self.scheduler.finish(req, "length")
        if req.grammar is not None and not req.is_finished:
            if not req.grammar.accept(token):  # the sampler masked every other token: a vtcore bug
                log.error("request %r: token %d is outside its grammar; aborted", req.request_id, token)
                self.scheduler.finish(req, "abort")
            elif req.grammar.terminated:
                self.scheduler.finish(req, "stop")

    def _piece(self, token: int, params: SamplingParams) -> str | None:
        """A logprob's decoded token (None without a tokenizer, or under ``detokenize=False``, as vLLM's)."""
        return None if self.tokenizer is None or not params.detokenize else self.tokenizer.decode([token])

    def _output(self, req: Request) -> RequestOutput | None:
        kind = req.params.output_kind
        finished = req.is_finished
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        text = req.detok.output_text(finished, req.stop_reason) if req.detok is not None else ""
        logprobs, prompt_logprobs = req.logprobs, req.prompt_logprobs
        if kind == RequestOutputKind.DELTA:  # (only the new tail is copied: a long output stays linear)
            sent_text, sent_tokens = req.sent
            tokens = req.token_ids[req.num_prompt_tokens + sent_tokens:]
            req.sent = (len(text), sent_tokens + len(tokens))
            text = text[sent_text:]
            logprobs = None if logprobs is None else logprobs[sent_tokens:]
            # the prompt's logprobs once, whole (or as far as they got, in the last output): as vLLM's deltas
            if req.sent_prompt_logprobs or prompt_logprobs is None or not (
                    len(prompt_logprobs) >= req.num_prompt_tokens or finished):
                prompt_logprobs = None
            else:
                req.sent_prompt_logprobs = True
        else:
            tokens, logprobs = req.output_token_ids, None if logprobs is None else list(logprobs)
        completion = CompletionOutput(0, text, tokens, req.cumulative_logprob if req.logprobs is not None else None,
                                      logprobs, req.finish_reason, req.stop_reason)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, prompt_logprobs, [completion],
                             finished, req.num_cached_tokens,
                             RequestMetrics(req.num_draft_tokens, req.num_accepted_tokens, req.queued_ts,
                                            req.scheduled_ts, req.first_token_ts, req.last_token_ts))

    # ------------------------------------------------------------------ front end (LLM, AsyncLLM)
    def limits(self) -> EngineLimits:
        """The fixed limits a request must fit (see ``Scheduler.add``)."""
        return EngineLimits(self.max_model_len, self.vocab_size, self.scheduler.max_num_seqs,
                            self.max_num_batched_tokens, self.pool.block_size, self.pool.num_blocks,
                            self.scheduler.by_priority, self.config.max_logprobs)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block and state snapshot (vLLM's ``reset_prefix_cache``); True when caching is on."""
        self.pool.reset()
        if self.scheduler.snapshots is not None:
            self.scheduler.snapshots.reset()
        return self.pool.caching

    def start_profile(self) -> None:
        """Record the steps from now on with torch.profiler (vLLM's; needs ``profiler_config``):
        :mod:`vtcore.engine.profiler`."""
        self.profiler.start()

    def stop_profile(self) -> str:
        """End the recording started by ``start_profile``; returns the trace file's path."""
        return self.profiler.stop()

    def shutdown(self) -> None:
        """Stop the runner's threads and tensor-parallel workers, and a draft model's (idempotent)."""
        self.runner.shutdown()
        draft = getattr(self.scheduler.proposer, "engine", None)
        if draft is not None:
            draft.shutdown()

    def stats(self) -> EngineStats:
        """The load now; safe from another thread (it reads lengths and counters only)."""
        spec, steps = self.spec_stats, self.scheduler.step_tokens
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), self.pool.usage,
                           self.scheduler.num_preemptions, self.pool.queries, self.pool.hits, spec.num_drafts,
                           spec.num_draft_tokens, spec.num_accepted_tokens, tuple(spec.accepted_per_position),
                           tuple(steps.counts), steps.sum)
