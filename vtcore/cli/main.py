"""``vtcore``: plugins, models, generate. Each subcommand is a function taking parsed args."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence, TextIO

from vtcore.errors import VtcoreError


def cmd_plugins(args: argparse.Namespace, out: TextIO) -> int:
    from vtcore.plugins.manager import get_plugins

    plugins = get_plugins()
    infos = list(plugins.infos.values())
    if args.json:
        json.dump([{"name": i.name, "module": i.module, "dist": i.dist, "version": i.version, "hooks": i.hooks,
                    "error": i.error, "heavy_imports": i.heavy_imports} for i in infos], out, indent=2)
        out.write("\n")
    else:
        for i in infos:
            status = f"FAILED: {i.error}" if i.error else ", ".join(i.hooks)
            out.write(f"{i.name:<20} {i.dist or '-'} {i.version or ''}\n    {status}\n")
            if i.heavy_imports:
                out.write(f"    SLOW: imports {', '.join(i.heavy_imports)} while registering; keep its entry point's "
                          "module light (import the model where model_cls names it)\n")
            for arch, names in sorted(plugins.conflicts.items()):  # (the one that loaded first is no less in it)
                if i.name in names and not i.error:
                    out.write(f"    CONFLICT: architecture {arch!r} is registered by {' and '.join(names)}; it "
                              "resolves to neither\n")
    return 1 if any(i.error for i in infos) else 0


def cmd_models(args: argparse.Namespace, out: TextIO) -> int:
    from vtcore.plugins.manager import get_plugins

    plugins = get_plugins()
    for arch, fam in sorted(plugins.architectures.items()):
        out.write(f"{arch:<40} family={fam.name} plugin={fam.plugin}"
                  f"{' device-tokens' if fam.consumes_device_tokens else ''}\n")
    for arch, names in sorted(plugins.conflicts.items()):
        out.write(f"{arch:<40} CONFLICT: registered by {', '.join(names)}\n")
    return 0


#: ``vtcore generate``'s sampling flags and their defaults (greedy, 64 tokens), under the checkpoint's
#: generation_config.json values, under the flags the user gives
_GENERATE_DEFAULTS = {"max_tokens": 64, "temperature": 0.0, "top_p": 1.0, "top_k": 0}


def cmd_generate(args: argparse.Namespace, out: TextIO) -> int:
    import attrs

    from vtcore import LLM, SamplingParams
    from vtcore.engine.arg_utils import engine_config_from_args

    llm = LLM(**attrs.asdict(engine_config_from_args(args)))
    given = {k: getattr(args, k) for k in _GENERATE_DEFAULTS if getattr(args, k) is not None}
    kw = {**_GENERATE_DEFAULTS, **llm.engine.default_sampling(), **given}
    try:
        params = SamplingParams(**kw)
    except ValueError as exc:  # a value the user typed is named by its flag
        msg = str(exc)
        for name in given:
            msg = msg.replace(f"SamplingParams.{name}=", f"--{name.replace('_', '-')}=")
        raise ValueError(msg) from None
    engine = llm.engine
    for i, text in enumerate(args.prompt):
        prompt: str | dict = text
        if args.chat:
            prompt = engine.chat_prompt([{"role": "user", "content": text}])
        rid = f"cli-{i}"
        engine.add_request(rid, prompt, params)
        if not args.chat:
            out.write(text)
        shown = 0
        while engine.has_unfinished_requests():
            for o in engine.step():
                piece = o.outputs[0].text[shown:]
                shown += len(piece)
                out.write(piece)
                out.flush()
        out.write("\n")
    return 0


def cmd_conformance(args: argparse.Namespace, out: TextIO) -> int:
    from vtcore.conformance.gate import main as gate_main
    from vtcore.engine.llm_engine import resolve_device

    resolve_device(args.device)  # no CUDA here: one error now, not a failed check per family
    quant = [] if args.no_quant else (args.quant or None)
    return gate_main(args.family or None, args.device, args.json, out, quant, args.check, args.tensor_parallel_size,
                     progress=sys.stderr)


def cmd_new_plugin(args: argparse.Namespace, out: TextIO) -> int:
    from vtcore.cli.scaffold import new_plugin
    from vtcore.plugins.manager import get_plugins

    plugins = get_plugins()
    if args.name in plugins.infos or args.name in plugins.families:
        raise ValueError(f"NAME={args.name!r}: a plugin or family of that name is installed; installing the "
                         "scaffold would replace it. Choose another name")
    if args.arch in plugins.architectures or args.arch in plugins.conflicts:
        by = plugins.architectures[args.arch].plugin if args.arch in plugins.architectures else \
            " and ".join(plugins.conflicts[args.arch])
        raise ValueError(f"--arch={args.arch!r}: installed plugin {by} serves it already; a second plugin for it "
                         "would leave it to neither (uninstall one, or narrow VTCORE_PLUGINS)")

    root = new_plugin(args.name, args.arch, args.dir)
    out.write(f"wrote {root}\nnext: write the model in {root}/vtcore_{args.name}/model.py, then\n"
              f"  pip install -e {root} && vtcore conformance --family {args.name}\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from vtcore.bench.serving import add_bench_parser, json_path
    from vtcore.conformance import CHECKS
    from vtcore.engine.arg_utils import add_engine_args, non_negative_int, positive_int
    from vtcore.tools.quantize import add_quantize_parser
    from vtcore.server.serve import add_serve_parser

    parser = argparse.ArgumentParser(prog="vtcore", description="An LLM inference engine extended by plugins.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plugins", help="list loaded plugins, their hooks and load errors")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_plugins)
    p = sub.add_parser("models", help="list the architectures registered plugins serve")
    p.set_defaults(func=cmd_models)
    p = sub.add_parser("conformance", help="prove every registered model family against its oracle and "
                                           "on the async path")
    p.add_argument("--family", action="append", help="check only this family (repeatable)")
    p.add_argument("--check", action="append", choices=CHECKS, metavar="CHECK",
                   help="run only this family check and the ones it needs (repeatable; one of: "
                        f"{', '.join(CHECKS)})")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--tensor-parallel-size", "-tp", type=positive_int("--tensor-parallel-size"), default=1,
                   metavar="N", help="run every check on engines of N ranks (worker processes: gloo on the "
                                     "CPU, NCCL on CUDA)")
    p.add_argument("--json", type=json_path, default=None, metavar="PATH", help="also write the results as JSON")
    quant = p.add_mutually_exclusive_group()
    quant.add_argument("--quant", action="append", metavar="FORMAT",
                       help="check only this quant format (repeatable; default: every registered one)")
    quant.add_argument("--no-quant", action="store_true", help="skip the quant section")
    p.set_defaults(func=cmd_conformance)
    p = sub.add_parser("new-plugin", help="scaffold a pip-installable model-family plugin package")
    p.add_argument("name", help="the family name, a lowercase identifier (package vtcore-NAME)")
    p.add_argument("--arch", required=True, help="the HF architecture it serves, e.g. LlamaForCausalLM")
    p.add_argument("--dir", default=".", help="where to create the package (default: here)")
    p.set_defaults(func=cmd_new_plugin)
    add_quantize_parser(sub)
    add_serve_parser(sub)
    add_bench_parser(sub)
    p = sub.add_parser("generate", help="generate text, streamed to the terminal")
    p.add_argument("prompt", nargs="+", help="one or more prompts")
    add_engine_args(p)
    given = "default: the checkpoint's generation_config.json, else"
    p.add_argument("--max-tokens", type=non_negative_int("--max-tokens"), default=None, help=f"{given} 64")
    p.add_argument("--temperature", type=float, default=None, help=f"0 is greedy ({given} 0)")
    p.add_argument("--top-p", type=float, default=None, help=f"{given} 1")
    p.add_argument("--top-k", type=int, default=None, help=f"{given} 0, no top-k")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    p.set_defaults(func=cmd_generate)
    return parser


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args, out or sys.stdout)
    except KeyboardInterrupt:  # Ctrl-C: no traceback
        sys.stderr.write("\n")
        return 130
    except BrokenPipeError:  # the reader left (| head): stop quietly, as other tools do
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except (VtcoreError, ValueError, TypeError, OSError, NotImplementedError) as exc:
        sys.stderr.write(f"vtcore {args.command}: error: {exc}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
