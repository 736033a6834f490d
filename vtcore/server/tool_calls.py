"""Tool calls in a model's output: the parser contract a family supplies (``vtcore_tool_parser``), the
hermes format Qwen3 and Qwen3.5 write, and the grammar that enforces ``tool_choice`` "required" or a
named function.

Hermes (Qwen's chat templates): each call is ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``;
text outside the blocks is the message's content. A block whose JSON does not parse stays content.
"""
from __future__ import annotations

import json
import uuid
from typing import Any, Protocol, Sequence

from vtcore.server.errors import APIError
from vtcore.server.reasoning import partial_suffix
from vtcore.server.structured import checked
from vtcore.structured import StructuredOutputsParams
from vtcore.structured.grammar import GrammarRefused, refused_as_value_error


class ToolParser(Protocol):
    """What the server needs of a family's tool-call format. A parser may also have ``names``: vLLM's
    ``--tool-call-parser`` names for its format, which ``vtcore serve --tool-call-parser`` then checks."""

    start: str  # the text that opens a call block (streaming holds output back from here)
    end: str

    @staticmethod
    def parse_block(block: str, tools: Sequence[dict[str, Any]] = ()) -> tuple[str, str] | None:
        """A call block's inside -> (function name, arguments as JSON text), or None: not a call.
        ``tools``: the request's (OpenAI's form), for a format whose values carry no type of their own."""
        ...

    @staticmethod
    def block_grammar(tools: list[dict[str, Any]], many: bool) -> str:
        """An EBNF grammar (xgrammar's dialect) of one call block of one of ``tools`` (``many``: one or
        more blocks), for tool_choice "required" or a named function; a tool it cannot express raises
        ``vtcore.structured.grammar.GrammarRefused`` naming it (``refused_as_value_error``)."""
        ...


class HermesToolParser:
    start, end = "<tool_call>", "</tool_call>"
    names = ("hermes",)

    @staticmethod
    def parse_block(block: str, tools: Sequence[dict[str, Any]] = ()) -> tuple[str, str] | None:
        try:
            call = json.loads(block)
        except json.JSONDecodeError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        args = call.get("arguments", {})
        return call["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)

    @staticmethod
    def block_grammar(tools: list[dict[str, Any]], many: bool) -> str:
        import xgrammar as xgr

        calls = [refused_as_value_error(f"function {t['function']['name']!r}",
                                        lambda t=t: xgr.Grammar.from_json_schema(json.dumps({
                                            "type": "object",
                                            "properties": {"name": {"const": t["function"]["name"]},
                                                           "arguments": t["function"].get("parameters")
                                                           or {"type": "object"}},
                                            "required": ["name", "arguments"]}), any_whitespace=False))
                 for t in tools]
        body = calls[0] if len(calls) == 1 else xgr.Grammar.union(*calls)
        block = str(xgr.Grammar.concat(xgr.Grammar.from_ebnf('root ::= "<tool_call>\\n"'), body,
                                       xgr.Grammar.from_ebnf('root ::= "\\n</tool_call>"')))
        if not many:
            return block
        return 'root ::= tool_block ("\\n" tool_block)*\n' + block.replace("root ::=", "tool_block ::=", 1)


def forced_calls(parser: ToolParser, tools: list[dict[str, Any]], many: bool) -> StructuredOutputsParams:
    """The constraint of a forced call (tool_choice "required" or a named function): ``parser``'s block grammar of
    ``tools``; a tool whose parameters xgrammar cannot compile is a 400 naming it (``GrammarRefused``)."""
    try:
        grammar = parser.block_grammar(tools, many)
    except GrammarRefused as exc:
        raise APIError(400, f"tools: {exc}", "tools") from None
    return checked(StructuredOutputsParams(grammar=grammar), "tools")


def call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"


def split_calls(parser: ToolParser, text: str, tools: Sequence[dict[str, Any]] = ()
                ) -> tuple[str, list[tuple[str, str]]]:
    """A whole output's (content outside the call blocks, [(name, arguments)]); ``tools``, the request's."""
    stream = CallStream(parser, tools)
    content, calls = stream.feed(text)
    rest, more = stream.flush()
    return content + rest, calls + more


class CallStream:
    """One output fed in deltas: ``feed``/``flush`` give (content delta, calls completed in it). The content is
    the text outside the call blocks with its leading and trailing white space stripped, as a whole output's:
    white space is held back until content follows it (so the deltas join to the whole output's content)."""

    def __init__(self, parser: ToolParser, tools: Sequence[dict[str, Any]] = ()) -> None:
        self.parser, self.tools = parser, tools
        self.held = ""
        self.in_block = False
        self.began = False  # content other than white space was given out
        self.space = ""  # white space after the last content given out

    def _trimmed(self, content: str) -> str:
        if not self.began:
            content = content.lstrip()
        body = content.rstrip()
        if not body:
            self.space += content
            return ""
        out, self.space, self.began = self.space + body, content[len(body):], True
        return out

    def feed(self, text: str) -> tuple[str, list[tuple[str, str]]]:
        content, calls = "", []
        text, self.held = self.held + text, ""
        p = self.parser
        while text:
            if self.in_block:
                end = text.find(p.end)
                if end < 0:
                    self.held, text = text, ""
                    break
                block, text = text[:end], text[end + len(p.end):]
                self.in_block = False
                call = p.parse_block(block.strip(), self.tools)
                if call is None:
                    content += p.start + block + p.end
                else:
                    calls.append(call)
            else:
                start = text.find(p.start)
                if start >= 0:
                    content += text[:start]
                    text, self.in_block = text[start + len(p.start):], True
                    continue
                keep = partial_suffix(text, p.start)
                content += text[:len(text) - keep]
                self.held, text = text[len(text) - keep:], ""
        return self._trimmed(content), calls

    def flush(self) -> tuple[str, list[tuple[str, str]]]:
        """What was held back once the output ended: an unclosed block is content (trailing white space goes)."""
        held, self.held = self.held, ""
        return self._trimmed(self.parser.start + held if self.in_block else held), []


class Qwen3XMLToolParser:
    """Qwen3.5's (and Qwen3-Coder's) XML calls: ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n
    </parameter>\\n...</function>\\n</tool_call>``. A value is typed by its parameter's schema in the
    request's tools: a string (its only type but null) is the text itself, any other type the JSON the text
    reads as; a parameter the tools do not describe is JSON where it parses, else text. ``block_grammar``
    writes every required parameter, in the schema's order: a string as one line of text without ``<``
    (its enum, or its min/max length), any other type as the JSON its schema allows."""

    start, end = "<tool_call>", "</tool_call>"
    names = ("qwen3_coder", "qwen3_xml")

    @staticmethod
    def parse_block(block: str, tools: Sequence[dict[str, Any]] = ()) -> tuple[str, str] | None:
        import re

        fn = re.fullmatch(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", block, re.DOTALL)
        if fn is None:
            return None
        name = fn.group(1).strip()
        schema = next((t["function"].get("parameters") for t in tools if isinstance(t, dict)
                       and isinstance(t.get("function"), dict) and t["function"].get("name") == name), None)
        props = schema.get("properties") if isinstance(schema, dict) else None
        props = props if isinstance(props, dict) else {}
        args: dict[str, Any] = {}
        for key, value in re.findall(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", fn.group(2), re.DOTALL):
            if _only_string(props.get(key)):
                args[key] = value
                continue
            try:
                args[key] = json.loads(value)
            except json.JSONDecodeError:
                args[key] = value
        return name, json.dumps(args, ensure_ascii=False)

    @staticmethod
    def block_grammar(tools: list[dict[str, Any]], many: bool) -> str:
        import xgrammar as xgr

        def lit(text: str) -> Any:
            return xgr.Grammar.from_ebnf("root ::= " + json.dumps(text))

        def call(t: dict[str, Any]) -> Any:
            params = t["function"].get("parameters") or {}
            parts = [lit(f"<tool_call>\n<function={t['function']['name']}>\n")]
            for key in params.get("required", []):
                prop = params.get("properties", {}).get(key, {})
                value = (xgr.Grammar.from_regex(_text_regex(prop)) if prop.get("type") == "string" else
                         xgr.Grammar.from_json_schema(json.dumps(prop), any_whitespace=False))
                parts += [lit(f"<parameter={key}>\n"), value, lit("\n</parameter>\n")]
            parts.append(lit("</function>\n</tool_call>"))
            return xgr.Grammar.concat(*parts)

        calls = [refused_as_value_error(f"function {t['function']['name']!r}", lambda t=t: call(t)) for t in tools]
        block = str(calls[0] if len(calls) == 1 else xgr.Grammar.union(*calls))
        if not many:
            return block
        return 'root ::= tool_block ("\\n" tool_block)*\n' + block.replace("root ::=", "tool_block ::=", 1)


def _only_string(prop: Any) -> bool:
    """Whether a parameter's schema allows strings and nothing else but null (a type, or an enum of strings)."""
    if not isinstance(prop, dict):
        return False
    kind = prop.get("type")
    if kind is None:
        return bool(prop.get("enum")) and all(isinstance(v, str) for v in prop["enum"])
    kinds = set(kind) if isinstance(kind, list) else {kind}
    return kinds - {"null"} == {"string"}


def _text_regex(prop: dict[str, Any]) -> str:
    """A string parameter's raw text as a regex: one of its enum, or a line without ``<`` of its lengths."""
    import re

    if prop.get("enum"):
        return "|".join(re.escape(str(v)) for v in prop["enum"])
    lo, hi = int(prop.get("minLength", 0)), prop.get("maxLength")
    return f"[^<\\n]{{{lo},{'' if hi is None else int(hi)}}}"

