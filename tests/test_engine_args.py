"""One set of engine arguments: ``vtcore generate``, ``bench`` and ``serve`` take EngineConfig's fields as
vLLM's flags and build the same config from them; ``LLM`` and ``AsyncLLM`` build theirs the same way.

No engine starts: ``LLMEngine`` (and the engine core process's client) is replaced by one that raises
``Built`` with the config it was given.
"""
from __future__ import annotations

import argparse
import io
import json

import attrs
import pytest

from vtcore import AsyncLLM, LLM
from vtcore.bench.serving import bench_engine_config
from vtcore.cli.main import build_parser, main
from vtcore.config import DEFAULT_MODEL, EngineConfig
from vtcore.engine import async_llm, llm
from vtcore.engine.arg_utils import engine_argv, engine_config_from_args
from vtcore.server.serve import served_model_names

#: the flags the work item lists (vLLM's names), each on every command that builds an engine
FLAGS = ("--max-num-seqs", "--max-num-batched-tokens", "--gpu-memory-utilization", "--num-kv-blocks", "--block-size",
         "--enforce-eager", "--no-enforce-eager", "--async-scheduling", "--no-async-scheduling", "--load-format",
         "--seed", "--max-model-len", "--dtype", "--generation-config", "--model", "--tokenizer", "--device")
COMMANDS = ("generate", "bench", "serve")
#: what each command needs besides engine flags to run as far as building the engine
EXTRA = {"generate": ["Hello"], "bench": ["--copy-mib", "1", "--output-len", "8", "--no-progress"],
         "serve": ["--port", "0"]}


class Built(Exception):
    """Raised in place of starting an engine; carries the config the engine was given."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__("engine not started")
        self.config = config


@pytest.fixture
def no_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    def built(config: EngineConfig) -> None:
        raise Built(config)

    monkeypatch.setattr(llm, "LLMEngine", built)
    monkeypatch.setattr(async_llm, "LLMEngine", built)
    monkeypatch.setattr(async_llm, "CoreClient", built)  # vtcore serve's engine core process


def built_config(*argv: str) -> EngineConfig:
    """The EngineConfig that ``vtcore ARGV`` hands the engine."""
    with pytest.raises(Built) as exc:
        main(list(argv), out=io.StringIO())
    return exc.value.config


def subparsers() -> dict[str, argparse.ArgumentParser]:
    """The CLI's subcommand parsers by name."""
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


@pytest.mark.parametrize("command", COMMANDS)
def test_every_engine_flag_is_on_every_command(command: str) -> None:
    flags = subparsers()[command]._option_string_actions
    assert [f for f in FLAGS if f not in flags] == []


def test_one_argv_gives_one_config_on_every_command(tiny_checkpoint, no_engine) -> None:
    path = tiny_checkpoint[0]
    engine = ["--tokenizer", path, "--device", "cpu", "--dtype", "bfloat16", "--load-format", "dummy", "--seed", "5",
              "--max-model-len", "128", "--max-num-seqs", "7", "--max-num-batched-tokens", "512", "--block-size", "32",
              "--num-kv-blocks", "33", "--gpu-memory-utilization", "0.5", "--enforce-eager", "--no-async-scheduling",
              "--generation-config", "vllm"]
    want = EngineConfig(model=path, tokenizer=path, device="cpu", dtype="bfloat16", load_format="dummy", seed=5,
                        max_model_len=128, max_num_seqs=7, max_num_batched_tokens=512, block_size=32,
                        num_kv_blocks=33, gpu_memory_utilization=0.5, enforce_eager=True, async_scheduling=False,
                        generation_config="vllm")
    assert built_config("generate", "--model", path, *engine, "Hello") == want
    assert built_config("bench", "--model", path, *engine, *EXTRA["bench"]) == want
    assert built_config("serve", path, *engine, *EXTRA["serve"]) == want
    offline = [flag for flag in EXTRA["bench"] if flag not in ("--output-len", "8")]  # (lengths of its own)
    assert built_config("bench", "--model", path, "--offline", *engine, *offline) == want  # through LLM


def test_a_config_written_back_as_flags_builds_itself_again(tiny_checkpoint) -> None:
    """``engine_argv`` (how ``bench --serve`` starts ``vtcore serve`` on the bench's own config)."""
    path = tiny_checkpoint[0]
    configs = [EngineConfig(), EngineConfig(model=path, device="cpu", dtype="bfloat16", max_num_seqs=7, seed=5,
                                            enforce_eager=True, async_scheduling=False, enable_prefix_caching=False,
                                            gpu_memory_utilization=0.5, num_kv_blocks=33),
               EngineConfig(model=path, speculative_config={"method": "ngram", "num_speculative_tokens": 3}),
               EngineConfig(model=path, override_generation_config={"temperature": 0.5, "max_new_tokens": 9})]
    for config in configs:
        argv = engine_argv(config)
        assert argv[0] == config.model
        assert engine_config_from_args(build_parser().parse_args(["serve", *argv, "--port", "0"])) == config
    assert engine_argv(EngineConfig()) == [DEFAULT_MODEL]  # defaults are left out


def _parse(command: str, *argv: str) -> argparse.Namespace:
    return build_parser().parse_args([command, *argv, *EXTRA[command]])


def test_no_flags_give_engine_config_defaults() -> None:
    assert engine_config_from_args(_parse("generate")) == EngineConfig()
    assert engine_config_from_args(_parse("serve")) == EngineConfig()
    # bench's own default: max_num_seqs is the largest concurrency (one decode graph per padded size up to
    # it), offline 256
    assert bench_engine_config(_parse("bench")) == attrs.evolve(EngineConfig(), max_num_seqs=32)
    assert bench_engine_config(_parse("bench", "--concurrency", "1,3")) == attrs.evolve(EngineConfig(), max_num_seqs=3)
    assert bench_engine_config(_parse("bench", "--offline")) == EngineConfig(max_num_seqs=256)
    assert bench_engine_config(_parse("bench", "--max-num-seqs", "5")).max_num_seqs == 5


@pytest.mark.parametrize("command", COMMANDS)
def test_tp_is_vllms_short_flag_for_tensor_parallel_size(command: str) -> None:
    assert engine_config_from_args(_parse(command, "-tp", "2")).tensor_parallel_size == 2


def test_async_scheduling_is_a_pair_of_flags() -> None:
    for argv, want in (([], None), (["--async-scheduling"], True), (["--no-async-scheduling"], False)):
        assert engine_config_from_args(_parse("serve", *argv)).async_scheduling is want


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("flag, value", [("--max-num-seqs", "0"), ("--gpu-memory-utilization", "1.5"),
                                         ("--dtype", "fp8"), ("--block-size", "-1")])
def test_bad_values_exit_2_naming_the_flag(command: str, flag: str, value: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        _parse(command, flag, value)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and value in err


def test_a_value_a_validator_refuses_is_named_by_its_flag(capsys, tmp_path) -> None:
    missing = str(tmp_path / "nowhere")
    assert main(["generate", "--generation-config", missing, "Hello"], out=io.StringIO()) == 2
    assert capsys.readouterr().err.startswith(f"vtcore generate: error: --generation-config={missing!r}: expected "
                                              "'auto' (the checkpoint's generation_config.json sampling defaults), "
                                              "'vllm' (SamplingParams' own) or a folder holding a "
                                              "generation_config.json")


def test_generation_config_folder_replaces_the_checkpoints(tiny_checkpoint, tmp_path) -> None:
    folder = tmp_path / "gen"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "top_k": 7}))
    engine = LLM(tiny_checkpoint[0], device="cpu", max_model_len=64, num_kv_blocks=4, generation_config=str(folder))
    assert engine.default_sampling() == {"temperature": 0.3, "top_k": 7}


def test_override_generation_config_sets_defaults_over_generation_config(tiny_checkpoint, tmp_path) -> None:
    """vLLM's ``override_generation_config``: generation_config.json keys whose values go over the checkpoint's (or,
    with ``generation_config="vllm"``, are the only defaults); a bad key or value is refused by name."""
    folder = tmp_path / "gen"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "top_k": 7}))
    common = dict(device="cpu", max_model_len=64, num_kv_blocks=4)
    engine = LLM(tiny_checkpoint[0], generation_config=str(folder),
                 override_generation_config={"temperature": 0.9, "max_new_tokens": 5}, **common)
    assert engine.default_sampling() == {"temperature": 0.9, "top_k": 7, "max_tokens": 5}
    plain = LLM(tiny_checkpoint[0], generation_config="vllm", override_generation_config='{"top_p": 0.5}', **common)
    assert plain.default_sampling() == {"top_p": 0.5}
    assert engine_config_from_args(_parse("serve", "--override-generation-config", '{"min_p": 0.1}')) \
        == EngineConfig(override_generation_config={"min_p": 0.1})
    with pytest.raises(ValueError, match=r"override_generation_config: unknown key\(s\) \['do_sample'\]; expected "
                                         r"generation_config.json's sampling keys \['max_new_tokens', "):
        EngineConfig(override_generation_config={"do_sample": True})
    with pytest.raises(ValueError, match=r"override_generation_config: top_k='5', expected a number \(or null"):
        EngineConfig(override_generation_config={"top_k": "5"})
    with pytest.raises(ValueError, match=r"override_generation_config='\{temperature': not valid JSON"):
        EngineConfig(override_generation_config="{temperature")
    with pytest.raises(ValueError, match=r"override_generation_config=\{'temperature': -1\}: "
                                         r"SamplingParams.temperature=-1: expected"):
        LLM(tiny_checkpoint[0], override_generation_config={"temperature": -1}, **common)
    # (vLLM's merge) a null drops the file's default; an override sets right a value the file has wrong
    dropped = LLM(tiny_checkpoint[0], generation_config=str(folder), override_generation_config={"top_k": None},
                  **common)
    assert dropped.default_sampling() == {"temperature": 0.3}
    (folder / "generation_config.json").write_text(json.dumps({"top_p": 0.0}))
    with pytest.raises(ValueError, match=r"generation_config.json: SamplingParams.top_p=0.0: .* or "
                                         r"override_generation_config to set this one"):
        LLM(tiny_checkpoint[0], generation_config=str(folder), **common)
    fixed = LLM(tiny_checkpoint[0], generation_config=str(folder), override_generation_config={"top_p": 0.9}, **common)
    assert fixed.default_sampling() == {"top_p": 0.9}


def test_generate_seed_is_the_engine_seed(no_engine) -> None:
    """As vLLM's ``--seed``: the engine's seed (it once seeded the prompt's SamplingParams instead)."""
    assert built_config("generate", "--seed", "7", "Hello").seed == 7


def test_llm_and_async_llm_build_one_config(no_engine) -> None:
    knobs = dict(device="cpu", dtype="half", max_num_seqs=3, async_scheduling=False)
    with pytest.raises(Built) as offline:
        LLM("some/model", **knobs)
    with pytest.raises(Built) as online:
        AsyncLLM("some/model", **knobs)
    assert offline.value.config == online.value.config == EngineConfig(model="some/model", **knobs)
    with pytest.raises(Built) as default:
        AsyncLLM()
    assert default.value.config == EngineConfig(model=DEFAULT_MODEL)


def test_llm_and_async_llm_refuse_an_unknown_knob_alike(no_engine) -> None:
    with pytest.raises(TypeError) as offline:
        LLM("m", max_batch_size=4)
    with pytest.raises(TypeError) as online:
        AsyncLLM("m", max_batch_size=4)
    text = str(offline.value)
    assert text.startswith("LLM(): unexpected keyword argument 'max_batch_size'; knobs are those of "
                           "vtcore.config.EngineConfig: model, tokenizer, "), text
    assert str(online.value) == "Async" + text


def test_a_misspelt_knob_is_named_with_the_one_meant(no_engine) -> None:
    with pytest.raises(TypeError, match=r"^LLM\(\): unexpected keyword argument 'max_modle_len' \(did you mean "
                                        r"'max_model_len'\?\); knobs are"):
        LLM("m", max_modle_len=64)


def test_vllm_arguments_without_use_here_are_taken_where_they_ask_for_nothing(no_engine) -> None:
    """A ported vLLM script's ``LLM(...)`` runs where its extra arguments ask for nothing (their defaults), and is
    refused naming the argument where they ask for what this engine does not do."""
    idle = dict(quantization=None, kv_cache_dtype="auto", tokenizer_mode="auto", disable_log_stats=True,
                enable_lora=False, swap_space=4, revision=None, download_dir=None, enable_chunked_prefill=True,
                compilation_config=None, hf_overrides={}, limit_mm_per_prompt=None, distributed_executor_backend="mp")
    with pytest.raises(Built) as built:
        LLM("m", max_model_len=64, **idle)
    assert built.value.config == EngineConfig(model="m", max_model_len=64)
    with pytest.raises(ValueError) as exc:
        AsyncLLM("m", kv_cache_dtype="fp8")
    assert str(exc.value) == ("AsyncLLM(): kv_cache_dtype='fp8': a vLLM engine argument this engine has no use for; "
                              "leave it out or pass 'auto': the KV cache is in the model's dtype")
    with pytest.raises(ValueError, match=r"^LLM\(\): quantization='awq': a vLLM engine argument"):
        LLM("m", quantization="awq")


# ------------------------------------------------------------------------------------ serve MODEL
def test_serve_takes_the_model_positionally(no_engine, capsys) -> None:
    assert built_config("serve", "acme/x", "--port", "0").model == "acme/x"
    assert capsys.readouterr().err == ""
    assert served_model_names(_parse("serve", "acme/x"), EngineConfig(model="acme/x")) == ["acme/x"]
    assert served_model_names(_parse("serve", "acme/x", "--served-model-name", "n", "m"),
                              EngineConfig(model="acme/x")) == ["n", "m"]
    assert served_model_names(_parse("serve"), EngineConfig()) == ["vtcore-default"]


def test_serve_model_option_still_works_with_a_warning(no_engine, capsys) -> None:
    assert built_config("serve", "--model", "acme/x", "--port", "0").model == "acme/x"
    assert capsys.readouterr().err == ("vtcore serve: warning: --model is deprecated; pass the model positionally: "
                                       "vtcore serve MODEL\n")
    assert built_config("serve", "acme/x", "--model", "acme/x", "--port", "0").model == "acme/x"  # the same: fine


def test_serve_model_twice_disagreeing_is_an_error(no_engine, capsys) -> None:
    assert main(["serve", "acme/x", "--model", "acme/y", "--port", "0"], out=io.StringIO()) == 2
    assert capsys.readouterr().err.endswith("vtcore serve: error: MODEL='acme/x' and --model='acme/y' disagree: "
                                            "pass the model once, as MODEL\n")
