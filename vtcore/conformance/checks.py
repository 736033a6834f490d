"""The checks the gate runs on one model family, each against an outside oracle.

The gate, not the plugin, picks the prompts (1 token, block-1, block, block+1, three blocks),
seeds, pool sizes and lengths; the plugin supplies only its tiny config and oracle class.
"""
from __future__ import annotations

import functools
import os
import random
from typing import Any, Callable

import torch

from vtcore.conformance import CHECKS
from vtcore.conformance.cuda_checks import CudaChecks
from vtcore.conformance.harness import build_engine, greedy, mixed_arrivals, run_engine
from vtcore.conformance.results import CheckResult, Failed, Progress, Skipped, run_in_order
from vtcore.conformance.device_drafts import DeviceDraftChecks, staggered
from vtcore.conformance.mtp import MTPChecks
from vtcore.conformance.structured import StructuredChecks
from vtcore.engine.llm_engine import LLMEngine
from vtcore.errors import raised_at
from vtcore.family import ConformanceExample, ModelFamily
from vtcore.outputs import CompletionOutput
from vtcore.plugins.manager import Plugins
from vtcore.sampling_params import SamplingParams
from vtcore.testing.runner_probes import withhold_override

BLOCK = 8
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 3}
#: a draft equal to the target proposes the target's greedy tokens: all accepted but for near-ties
DRAFT_ACCEPTANCE = 0.9
PROMPT_LENGTHS = (1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK)
MAX_TOKENS_BRACKET = (*range(1, 9), 16, 33)
LOGPROB_TOL = 1e-4
MIN_LAYERS, MIN_DISTINCT, STRENGTH_TOKENS = 2, 8, 32
SEED = 0
#: What every other check needs: run even when ``--check`` names others.
PREREQUISITES = ("example", "structure", "declares-device-tokens")


def _check_oracle(example: ConformanceExample) -> None:
    """The example's oracle class imports and its config model_type is the example's: the gate saves
    the oracle's checkpoint from that config, so another model_type (several map to one transformers
    class) gives another model's tensor names, and the family would be blamed for them."""
    from vtcore.family import resolve_ref

    try:
        cls = resolve_ref(example.oracle)
    except (ImportError, AttributeError) as exc:
        raise Failed(f"the oracle {example.oracle!r} cannot be imported: {type(exc).__name__}: {exc}") from None
    model_type = example.hf_config.get("model_type")
    expected = getattr(getattr(cls, "config_class", None), "model_type", None)
    if expected and model_type != expected:
        raise Failed(f"the example's model_type is {model_type!r}, but its oracle {example.oracle} takes "
                     f"{expected!r}; set model_type to {expected!r}")


def _cached_hint(rids: list[str], cached: dict[str, int], stateful: bool = False) -> str:
    hits = [r for r in rids if cached.get(r)]
    if not hits:
        return f"requests {rids} computed their whole prompts"
    hint = f"requests {hits} started from cached KV blocks ({', '.join(str(cached[r]) for r in hits)} tokens): a " \
           "prefill chunk must attend over the context already cached for it, at its true positions"
    if stateful:
        hint += "; and resume from the state snapshot at the prefix's end: a stateful layer must start each " \
                "segment from its state_slots entry and end it in its state_out_slots entry (StatefulLayer); a " \
                "lone chunk padded to its bucket must leave the rows past AttentionMetadata.state_tokens out of " \
                "the state"
    return hint


class FamilyGate(CudaChecks, StructuredChecks, MTPChecks, DeviceDraftChecks):
    """Runs every check on one family, lazily building the oracle checkpoint and engines it needs."""

    def __init__(self, plugins: Plugins, family: ModelFamily, device: str, workdir: str,
                 tensor_parallel_size: int = 1) -> None:
        self.plugins, self.family, self.device, self.workdir = plugins, family, device, workdir
        self.tensor_parallel_size = tensor_parallel_size
        self._engines: list[LLMEngine] = []  # built by the running check, shut down after it
        self.example: ConformanceExample | None = None
        self._hf: Any = None
        self._path: str | None = None
        self.results: dict[str, CheckResult] = {}

    # ------------------------------------------------------------------ fixtures
    @property
    def name(self) -> str:
        return self.family.name

    @property
    def oracle(self) -> str:
        return self.example.oracle if self.example else "-"

    def _checkpoint(self) -> tuple[str, Any]:
        if self._path is None:
            from vtcore.testing.oracle import hf_model, save_checkpoint

            self._hf = hf_model(self.example.hf_config, SEED, self.example.oracle)
            self._path = save_checkpoint(self._hf, os.path.join(self.workdir, self.name))
        return self._path, self._hf

    def engine(self, mode: str = "sync", path: str | None = None, **knobs: Any) -> LLMEngine:
        """An engine over the oracle checkpoint (or ``path``): float32, the gate's blocks and pool and
        tensor-parallel size unless ``knobs`` say; shut down when the check that built it ends."""
        path = path or self._checkpoint()[0]
        engine = build_engine(path, mode, **{"device": self.device, "dtype": "float32", "block_size": BLOCK,
                                             "num_kv_blocks": 256, "max_model_len": 128, "max_num_seqs": 32,
                                             "seed": SEED, "tensor_parallel_size": self.tensor_parallel_size,
                                             **knobs})
        self._engines.append(engine)
        return engine

    def prompts(self) -> list[list[int]]:
        rng = random.Random(SEED)
        vocab = int(self.example.hf_config["vocab_size"])
        return [[rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENGTHS]

    # ------------------------------------------------------------------ driver
    def run(self, only: list[str] | None = None, progress: Progress | None = None) -> dict[str, CheckResult]:
        """Run every check in order, or only those of ``only`` and the checks they need (the others
        are reported as skipped), each result handed to ``progress`` as it ends. Tensor-parallel workers
        serve one engine after another."""
        from vtcore.worker.tensor_parallel import reused_workers

        with reused_workers():
            return run_in_order(self.name, CHECKS, functools.partial(self._run_check, only=only), self.results,
                                progress)

    def _run_check(self, check: str, only: list[str] | None) -> CheckResult:
        try:
            method: Callable[[], str] = getattr(self, "check_" + check.replace("-", "_"))
            if only is not None and check not in only and check not in PREREQUISITES:
                raise Skipped("not selected (--check)")
            self._require(check)
            return CheckResult(check, "pass", method() or "")
        except Skipped as exc:
            return CheckResult(check, "skip", str(exc))
        except Failed as exc:
            return CheckResult(check, "fail", f"family {self.name!r}: {exc}")
        except Exception as exc:  # noqa: BLE001 - a crash in a check is a failure of the family
            return CheckResult(check, "fail", f"family {self.name!r}: {check} raised {type(exc).__name__}: {exc}"
                                              f"{_raised_at(exc)}")
        finally:
            while self._engines:
                self._engines.pop().shutdown()

    def _require(self, check: str) -> None:
        def failed(name: str) -> bool:
            return name in self.results and self.results[name].status != "pass"

        if check != "example" and failed("example"):
            raise Skipped("no usable conformance example")
        if check not in ("example", "structure") and failed("structure"):
            raise Skipped("the structure check failed (see its message)")
        if check.startswith("async") and failed("declares-device-tokens"):
            raise Skipped("async scheduling is refused for a family that does not declare device-token consumption")

    # ------------------------------------------------------------------ checks
    def check_example(self) -> str:
        example = self.plugins.pm.hook.vtcore_conformance_example(family=self.family)
        if example is None:
            raise Failed("no conformance example: set ModelFamily.conformance_example to a 'module:function' "
                         "returning a ConformanceExample (a tiny config and its HF oracle class)")
        if not isinstance(example, ConformanceExample):
            raise Failed(f"the conformance example is {type(example).__name__}, expected a ConformanceExample")
        arch = (example.hf_config.get("architectures") or [None])[0]
        if arch not in self.family.architectures:
            raise Failed(f"the example's architecture {arch!r} is not one of the family's {self.family.architectures}")
        _check_oracle(example)
        self.example = example
        return f"oracle {example.oracle}"

    def check_structure(self) -> str:
        from vtcore.layers.embedding import EmbedInto

        info = self.plugins.infos.get(self.family.plugin)
        if info is None or "vtcore_model_families" not in info.hooks:
            raise Failed(f"plugin {self.family.plugin!r} does not implement vtcore_model_families")
        engine = self.engine()
        if engine.family.name != self.name:
            raise Failed(f"its example's checkpoint builds family {engine.family.name!r}, not {self.name!r}")
        model = engine.runner.model
        for attr in ("forward", "compute_logits"):
            if not callable(getattr(model, attr, None)):
                raise Failed(f"{type(model).__name__} has no {attr}()")
        if not any(isinstance(m, EmbedInto) for m in model.modules()):
            raise Failed(f"{type(model).__name__} has no EmbedInto module: embed tokens through "
                         "vtcore.layers.embedding.EmbedInto so the device-token override reaches it")
        return f"{type(model).__name__} from plugin {self.family.plugin!r}"

    def check_declares_device_tokens(self) -> str:
        if not self.family.consumes_device_tokens:
            raise Failed("does not declare consumes_device_tokens=True, so async serving is refused for it; "
                         "embed through EmbedInto and declare it in its ModelFamily")
        return "consumes_device_tokens=True"

    def check_example_strength(self) -> str:
        from vtcore.testing.oracle import teacher_forced_logits

        cfg = self.example.hf_config
        layers = int(cfg.get("num_hidden_layers") or len(cfg.get("layer_types") or []))
        if layers < MIN_LAYERS:
            raise Failed(f"weak example: {layers} layer(s); the gate needs at least {MIN_LAYERS} "
                         "(a cache bug between layers would go unseen)")
        _, hf = self._checkpoint()
        ids = self.prompts()[2]
        for _ in range(STRENGTH_TOKENS):
            ids.append(int(teacher_forced_logits(hf, ids)[-1].argmax()))
        distinct = len(set(ids[-STRENGTH_TOKENS:]))
        if distinct < MIN_DISTINCT:
            raise Failed(f"weak example: {STRENGTH_TOKENS} greedy oracle tokens hold only {distinct} distinct "
                         f"tokens (need {MIN_DISTINCT}); use initializer_range near 0.1")
        return f"{layers} layers, {distinct} distinct tokens in {STRENGTH_TOKENS}"

    def check_weights(self) -> str:
        """Each checkpoint tensor lands bit for bit in its parameter; at a tensor-parallel size above 1, in
        rank 0's share of it: whole where the parameter is replicated, else 1/size of it along one
        dimension, starting with the tensor's first slice along it (the oracle checks prove the rest)."""
        from safetensors import safe_open

        from vtcore.loading.weights import WeightMapper

        path, _ = self._checkpoint()
        model = self.engine().runner.model
        mapper = WeightMapper(model)
        checked = parts = 0
        with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
            for name in f.keys():
                target = mapper.target(name)
                if target is None:
                    continue
                pname, shard = target
                param = mapper.params[pname].data
                if shard is not None:
                    param = model.get_submodule(pname.rpartition(".")[0]).shard_view(mapper.params[pname], shard)
                tensor = f.get_tensor(name).to(param.dtype)
                where = f"{pname!r}" + (f" shard {shard!r}" if shard else "")
                if self.tensor_parallel_size > 1 and param.shape != tensor.shape:
                    self._rank0_part(name, tensor, param.cpu(), where)
                    parts += 1
                elif param.shape != tensor.shape or not torch.equal(param.cpu(), tensor):
                    raise Failed(f"checkpoint tensor {name!r} does not land bit for bit in parameter {where}: "
                                 "fix the family's weight mapping (packed_modules_mapping / weight_loader)")
                checked += 1
        return f"{checked} tensors land bit for bit" + (
            f" ({parts} of them as rank 0's part of {self.tensor_parallel_size})" if parts else "")

    def _rank0_part(self, name: str, tensor: torch.Tensor, part: torch.Tensor, where: str) -> None:
        size = self.tensor_parallel_size
        dims = [d for d in range(tensor.dim()) if part.dim() == tensor.dim() and part.shape[d] != tensor.shape[d]]
        if len(dims) != 1 or part.shape[dims[0]] * size != tensor.shape[dims[0]]:
            raise Failed(f"at tensor_parallel_size={size}, rank 0's parameter {where} has shape {tuple(part.shape)} "
                         f"for checkpoint tensor {name!r} of {tuple(tensor.shape)}: a sharded layer keeps 1/{size} "
                         "of each tensor along one dimension (vtcore.layers.parallel)")
        d = dims[0]
        if not torch.equal(part.narrow(d, 0, 1), tensor.narrow(d, 0, 1)):
            raise Failed(f"at tensor_parallel_size={size}, rank 0's part of checkpoint tensor {name!r} in parameter "
                         f"{where} does not start with the tensor's first slice along dimension {d}: rank 0 holds "
                         "the first part of each block (vtcore.layers.parallel.rank_part)")

    def check_parameters(self) -> str:
        from vtcore.conformance.sensitivity import MIN_EFFECT, tensor_effects

        _, hf = self._checkpoint()
        effects = tensor_effects(hf, self.prompts()[-1])
        weak = sorted(n for n, e in effects.items() if e < MIN_EFFECT)
        if weak:
            raise Failed(f"the example leaves {len(weak)} oracle tensor(s) untestable: resetting "
                         f"{', '.join(repr(n) for n in weak[:8])}{' ...' if len(weak) > 8 else ''} moves no "
                         f"log-probability of the oracle by {MIN_EFFECT:g} or more, so a family that ignores it "
                         "passes; choose an example config under which every tensor matters")
        least = min(effects, key=effects.__getitem__)
        return f"resetting any of {len(effects)} tensors moves the oracle's logprobs by >= {effects[least]:.2g} " \
               f"(least: {least})"

    # ------------------------------------------------------------------ against the oracle
    def _violation(self, hf: Any, prompt: list[int], out: CompletionOutput, is_greedy: bool,
                   strict: bool = False) -> str | None:
        """What is wrong with ``out`` under the oracle ``hf`` teacher-forced on it (None: nothing): a
        greedy token that is neither the oracle's argmax nor within the near-tie tolerance of it, or a
        returned logprob more than ``LOGPROB_TOL`` from the oracle's. ``strict`` also refuses an oracle
        whose logits are flat at a position (every token a near-tie: a degenerate oracle agrees with anything)."""
        from vtcore.testing.oracle import teacher_forced_logits

        ids = list(out.token_ids)
        lp = torch.log_softmax(teacher_forced_logits(hf, prompt + ids[:-1])[len(prompt) - 1:].double(), -1)
        for pos, tok in enumerate(ids):
            top = int(lp[pos].argmax())
            gap = float(lp[pos, top] - lp[pos, tok])
            if strict and float(lp[pos, top] - lp[pos].min()) <= LOGPROB_TOL:
                return "flat"
            if is_greedy and tok != top and gap > LOGPROB_TOL:
                return f"greedy tokens differ from {self.oracle} beyond near-ties: prompt of {len(prompt)} tokens, " \
                       f"position {pos}: ours {tok}, oracle {top} (logit gap {gap:.3g})"
            if out.logprobs:
                err = abs(out.logprobs[pos][tok].logprob - float(lp[pos, tok]))
                if err > LOGPROB_TOL:
                    return f"sampled-token logprob differs from {self.oracle} by {err:.3g} (> {LOGPROB_TOL}) at " \
                           f"position {pos} of the prompt of {len(prompt)} tokens"
        return None

    def _against_oracle(self, cases: list[tuple[str, list[int], SamplingParams, CompletionOutput]],
                        context: Callable[[list[str]], str] = lambda rids: "") -> None:
        """Fail if the oracle disagrees with any of ``cases`` (request id, prompt, params, output): on
        the first, naming the oracle tensor whose reset would explain it, else ``context(the ids of
        every request it disagrees with)``."""
        from vtcore.conformance.sensitivity import likely_cause

        _, hf = self._checkpoint()
        bad: dict[str, str] = {}
        for rid, prompt, params, out in cases:
            if len(out.token_ids) != params.max_tokens:
                raise Failed(f"request {rid!r} returned {len(out.token_ids)} tokens, not max_tokens={params.max_tokens}")
            wrong = self._violation(hf, prompt, out, params.temperature == 0)
            if wrong:
                bad[rid] = wrong
        if bad:
            # (a family that ignores a tensor computes what the oracle with that tensor reset does, for every
            # request: a reset that explains only the failing ones can be a coincidence)
            cause = likely_cause(hf, lambda m: all(
                self._violation(m, prompt, out, params.temperature == 0, True) is None
                for _, prompt, params, out in cases))
            first = next(rid for rid, *_ in cases if rid in bad)
            raise Failed(bad[first] + (cause or context(list(bad))))

    def _cases(self, engine: LLMEngine, params: list[SamplingParams], prompts: list[list[int]] | None = None
               ) -> list[tuple[str, list[int], SamplingParams, CompletionOutput]]:
        """(request id, prompt, params, final output) of ``prompts`` (default: the gate's), request i
        with ``params[i]``, all arriving at step 0."""
        prompts = self.prompts() if prompts is None else prompts
        finals: dict[str, CompletionOutput] = {}
        run_engine(engine, {0: [(str(i), p, params[i]) for i, p in enumerate(prompts)]}, finals=finals)
        return [(str(i), p, params[i], finals[str(i)]) for i, p in enumerate(prompts)]

    def check_oracle_greedy(self) -> str:
        self._against_oracle(self._cases(self.engine(), [greedy(16)] * len(PROMPT_LENGTHS)))
        return f"prompts of {', '.join(map(str, PROMPT_LENGTHS))} tokens, 16 greedy tokens each"

    def check_oracle_logprobs(self) -> str:
        params = [SamplingParams(temperature=1.0, seed=SEED + i, max_tokens=12, ignore_eos=True, logprobs=0)
                  for i in range(len(PROMPT_LENGTHS))]
        self._against_oracle(self._cases(self.engine(), params))
        return f"12 sampled tokens on each prompt, logprobs within {LOGPROB_TOL}"

    def check_oracle_schedule(self) -> str:
        from vtcore.conformance.schedule import KNOBS, ScheduleLog, hostile_arrivals

        arrivals = hostile_arrivals(int(self.example.hf_config["vocab_size"]), SEED)
        requests = {rid: (ids, params) for batch in arrivals.values() for rid, ids, params in batch}
        log, finals = ScheduleLog(), {}
        ref, ref_batches = run_engine(self.engine("sync", **KNOBS), arrivals, log, finals)
        if log.missing():
            raise Failed(f"the gate's hostile schedule ran without {', '.join(log.missing())}: vtcore's scheduler "
                         "changed under the gate (a vtcore bug, not the family's)")
        self._against_oracle([(rid, ids, params, finals[rid]) for rid, (ids, params) in requests.items()],
                             lambda rids: f" (sync; {log.hint(rids, len(requests))})")
        modes = ("async",) if self.family.consumes_device_tokens else ()
        for mode in modes:
            got, batches = run_engine(self.engine(mode, **KNOBS), arrivals)
            if batches != ref_batches:
                raise Failed(f"{mode} scheduled different batches than sync under the hostile schedule")
            bad = [rid for rid in ref if got.get(rid) != ref[rid]]
            if bad:
                raise Failed(f"{mode} differs from sync under the hostile schedule for request {bad[0]!r}: "
                             f"{got.get(bad[0])} vs {ref[bad[0]]} ({log.hint(bad, len(ref))})")
        return f"{len(requests)} requests through {', '.join(sorted(log.seen))}; sync within the oracle's " \
               f"tolerances{', async equal to sync' if modes else ' (async refused for this family)'}"

    def check_prefix_cache(self) -> str:
        from vtcore.conformance.prefix import next_turn, prefix_workload

        vocab = int(self.example.hf_config["vocab_size"])
        case = prefix_workload(vocab, SEED, BLOCK)
        modes = ("sync", "async") if self.family.consumes_device_tokens else ("sync",)
        runs = {}
        for mode in modes:
            engine = self.engine(mode, state_snapshot_interval=BLOCK)  # stateful layers: a snapshot every block
            if not engine.pool.caching:
                raise Skipped("the family runs without prefix caching (a stateful layer cannot snapshot its state)")
            cached: dict[str, int] = {}

            def admitted(batch: Any) -> None:
                for s in batch:
                    cached.setdefault(s.request.request_id, s.request.num_cached_tokens)

            finals: dict[str, CompletionOutput] = {}
            stateful = bool(engine.runner.stateful_layers)
            first = run_engine(engine, case.arrivals, admitted, finals)
            turn = next_turn(vocab, SEED, BLOCK, case.prompts["first"][0], first[0]["first"])
            second = run_engine(engine, turn.arrivals, admitted, finals)  # the same engine: its cache
            expected, prompts = {**case.expected, **turn.expected}, {**case.prompts, **turn.prompts}
            if cached != expected:
                wrong = {rid: (n, expected[rid]) for rid, n in cached.items() if n != expected[rid]}
                raise Failed(f"{mode}: prompt tokens taken from the prefix cache (ours, the hashes') differ: "
                             f"{wrong} (a vtcore bug, not the family's)")
            self._against_oracle([(rid, ids, params, finals[rid]) for rid, (ids, params) in prompts.items()],
                                 lambda rids: f" ({mode}; {_cached_hint(rids, cached, stateful)})")
            if engine.runner.chunk_graphs and not engine.runner.padded_chunk_steps:
                raise Failed(f"{mode}: no prefill chunk after a cache hit took the padded chunk path, which serves "
                             "them (a vtcore bug: the gate no longer checks that path)")
            runs[mode] = (first, second)
        if len(runs) > 1 and runs["async"] != runs["sync"]:
            raise Failed("async scheduled different batches or tokens than sync with prefix caching")
        return f"{len(case.prompts) - 1} requests sharing prefixes of 5 to {len(case.prompts['first'][0])} tokens " \
               f"with the first (while it runs and after) and a next turn over its answer, " \
               f"{sum(case.expected.values()) + sum(turn.expected.values())} prompt tokens from the cache, within " \
               f"the oracle's tolerances{', async equal to sync' if len(runs) > 1 else ''}"

    def check_speculative(self) -> str:
        """Speculative decoding, k=3: the n-gram proposer on prompts that repeat a phrase; a replay of the
        plain greedy continuations with one proposed token changed in a cycle, so verify rows accept
        every length from none to all; and the family's own example as its draft model (its own engine
        and KV cache), which must have nearly every proposal accepted. Each continuation is
        teacher-forced against the oracle. Then the n-gram and the draft model with async scheduling,
        drafting on the device (``vtcore.conformance.device_drafts``; a stateful draft resumes its state from
        the last accepted token as the target does), and the family's MTP head if it has one."""
        from vtcore.spec.replay import ReplayProposer

        rng = random.Random(SEED + 2)
        vocab = int(self.example.hf_config["vocab_size"])
        phrases = [[rng.randrange(vocab) for _ in range(rng.randrange(3, 6))] for _ in range(3)]
        prompts = [(p * n)[:n] for p, n in zip(phrases, (6, 11, 20))] + self.prompts()[2:4]
        k = SPECULATIVE["num_speculative_tokens"]
        target = self.engine("sync")
        plain = self._cases(target, [greedy(16)] * len(prompts), prompts)
        report = []
        path, _ = self._checkpoint()
        draft = {"method": "draft_model", "model": path, "num_speculative_tokens": k}
        for name, config, proposer in (
                ("n-gram", SPECULATIVE, None),
                ("replay", SPECULATIVE, ReplayProposer([ids + out.token_ids for _, ids, _, out in plain], vocab,
                                                       reject_every=True)),
                ("draft-model", draft, None)):
            engine = self.engine("sync", speculative_config=config)
            if proposer is not None:
                engine.scheduler.proposer = proposer
            self._against_oracle(self._cases(engine, [greedy(16)] * len(prompts), prompts),
                                 lambda rids: f" ({name} proposals; requests {rids} decoded through verify rows: "
                                              "a verify row is a prefill chunk: a prefill chunk must attend over the "
                                              "context already cached for it, each draft token see the state of those "
                                              "before it, and a rejection leave no trace: end each state segment in "
                                              "its state_out_slots entry; padded verify rows: the state after each "
                                              "token in its state_out_index slot)")
            stats = engine.spec_stats
            report.append(f"{name}: {stats.num_drafts} verify rows, {stats.num_accepted_tokens} of "
                          f"{stats.num_draft_tokens} proposed tokens accepted")
            if name == "replay":
                replayed = stats
        if stats.num_accepted_tokens < DRAFT_ACCEPTANCE * stats.num_draft_tokens or not stats.num_drafts:
            raise Failed(f"the family's own example as its draft had {stats.num_accepted_tokens} of "
                         f"{stats.num_draft_tokens} proposed tokens accepted: a draft equal to the target must "
                         "propose the target's greedy tokens (the draft engine runs the family as a target does)")
        stats = replayed
        if not (0 < stats.accepted_per_position[k - 1] < stats.num_drafts):
            raise Failed(f"the replayed proposals accepted {stats.accepted_per_position} tokens per position in "
                         f"{stats.num_drafts} verify rows, not every run length (a vtcore bug)")
        if self.family.consumes_device_tokens:
            report.append(self._device_drafts_pass("n-gram", "mirror-off", {"speculative_config": SPECULATIVE},
                                                   staggered(prompts, 16)))
            report.append(self._device_drafts_pass("draft-model", "mirror-off", {"speculative_config": draft},
                                                   staggered(prompts, 16), min_acceptance=DRAFT_ACCEPTANCE))
        mtp = self._mtp_pass(prompts, BLOCK, 2 * BLOCK)
        report.append(mtp or "no MTP head (vtcore_mtp_head builds none for this family)")
        return f"{len(prompts)} requests; {'; '.join(report)}; within the oracle's tolerances"

    def check_async_abc(self) -> str:
        arrivals = {0: [("a", self.prompts()[1], greedy(16)), ("b", self.prompts()[3], greedy(16))]}
        ref, _ = run_engine(self.engine("sync"), arrivals)
        withheld = self.engine("async")
        withhold_override(withheld.runner)
        try:
            b, _ = run_engine(withheld, arrivals)
        except Exception:  # noqa: BLE001 - B must raise (or differ): that is the poison biting
            b = None
        if b == ref:
            raise Failed("withholding the device-token override changed nothing: the placeholder poison "
                         "did not reach the model's embedding")
        engine = self.engine("async")
        try:
            got, _ = run_engine(engine, arrivals)
        except Exception as exc:  # noqa: BLE001
            raise Failed(f"EmbedInto ignores the device-token override (async with the mirror raised "
                         f"{type(exc).__name__}: {exc})") from None
        runner = engine.runner
        if got != ref:
            raise Failed("EmbedInto ignores the device-token override: async with the mirror differs from sync")
        if runner.stale_forwards == 0 or runner.consuming_forwards != runner.stale_forwards:
            raise Failed(f"the override was consumed in {runner.consuming_forwards} of {runner.stale_forwards} "
                         "decode steps: EmbedInto must embed the override's device ids on every one")
        return f"B {'raised' if b is None else 'differed'}; C equal, override consumed on all " \
               f"{runner.stale_forwards} decode steps"

    def _same_as_sync(self, arrivals: dict, modes: tuple[str, ...] = ("async", "mirror-off"), repeat: int = 1) -> None:
        sync = self.engine("sync")
        refs = [run_engine(sync, arrivals) for _ in range(repeat)]  # later runs hit the prefix cache
        for mode in modes:
            engine = self.engine(mode)
            for ref, ref_batches in refs:
                got, batches = run_engine(engine, arrivals)
                if batches != ref_batches:
                    raise Failed(f"{mode} scheduled different batches than sync for the same requests")
                if got != ref:
                    bad = next(r for r in ref if got.get(r) != ref[r])
                    raise Failed(f"{mode} differs from sync for request {bad!r}: {got.get(bad)} vs {ref[bad]}")

    def check_async_batch1_x5(self) -> str:
        self._same_as_sync({0: [("one", self.prompts()[3], greedy(24))]}, ("async",), repeat=5)
        return "5 runs of one engine equal sync"

    def check_async_concurrency(self) -> str:
        vocab = int(self.example.hf_config["vocab_size"])
        for n in (4, 12):
            self._same_as_sync(mixed_arrivals(n, n, vocab))
        return "brackets of 4 and 12 requests (late arrivals, sampled and greedy), mirror on and off"

    def check_async_max_tokens(self) -> str:
        prompt = self.prompts()[2]
        self._same_as_sync({0: [(f"m{n}", prompt[:n % BLOCK + 1], greedy(n)) for n in MAX_TOKENS_BRACKET]})
        return f"max_tokens {', '.join(map(str, MAX_TOKENS_BRACKET))}"


def _raised_at(exc: BaseException) -> str:
    """Where a check's unexpected exception was raised: the innermost frame outside installed libraries (torch's,
    triton's), so that a failure seen only in a GPU run's log points at the engine's or the plugin's line."""
    return raised_at(exc, lambda file: "-packages" + os.sep not in file, innermost_if_none=True)
