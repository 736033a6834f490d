"""Output text made in the front end, off the engine core's critical path.

An engine core process (``vtcore.engine.core_process``) detokenizes only the requests that have stop
strings (it must find them to stop the request); every other request's outputs leave the core with their
token ids and no text, and the front end's receiving thread fills the text in with the same incremental
detokenizer, for each completion of a request and whatever its output kind, so the outputs equal those of
an engine that detokenizes everything itself.
"""
from __future__ import annotations

from typing import Any

from vtcore.engine.detokenizer import IncrementalDetokenizer
from vtcore.outputs import RequestOutput
from vtcore.sampling_params import RequestOutputKind, SamplingParams


def text_in_front_end(params: SamplingParams) -> bool:
    """Whether an engine core leaves this request's text to the front end (it has text, and no stop strings)."""
    return params.detokenize and not params.stop


class _Completion:
    """One completion's detokenizer, how many of its tokens it has taken and how much text was sent."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int], params: SamplingParams) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens, [], False)
        self.fed = self.sent = 0


class FrontEndText:
    """Fills in the text of core outputs whose requests the core does not detokenize: ``added`` as the core
    accepts a request, ``fill`` for each of its outputs (both on the receiving thread)."""

    def __init__(self, tokenizer: Any, eos_token_ids: list[int]) -> None:
        self.tokenizer, self.eos_token_ids = tokenizer, set(eos_token_ids)
        self._params: dict[str, SamplingParams] = {}
        self._completions: dict[str, dict[int, _Completion]] = {}  # per request, per completion index

    def added(self, request_id: str, params: SamplingParams) -> None:
        """The core accepted a request of ``params``."""
        if self.tokenizer is not None and text_in_front_end(params):
            self._params[request_id] = params

    def fill(self, out: RequestOutput) -> None:
        """Put the text into ``out`` (its prompt ids restored) if the front end makes it."""
        rid = out.request_id
        params = self._params.get(rid)
        if params is None:
            return
        delta = params.output_kind == RequestOutputKind.DELTA
        completions = self._completions.setdefault(rid, {})
        for c in out.outputs:
            state = completions.get(c.index)
            if state is None:
                state = completions[c.index] = _Completion(self.tokenizer, out.prompt_token_ids, params)
            new = c.token_ids if delta else c.token_ids[state.fed:]
            if new and self._stopped_by(new[-1], c, params):
                new = new[:-1]  # the stopping token's text is not in the output (as the engine leaves it out)
            for token in new:
                state.detok.add(token)
            state.fed += len(c.token_ids) if delta else len(c.token_ids) - state.fed
            text = state.detok.output_text(c.finish_reason is not None, c.stop_reason)
            c.text = text[state.sent:] if delta else text
            state.sent = len(text)
        if out.finished:
            del self._params[rid], self._completions[rid]

    def _stopped_by(self, token: int, c: Any, params: SamplingParams) -> bool:
        """Whether ``token``, ``c``'s last, stopped it as a stop token or EOS (a grammar's end may also finish
        "stop", on a token ``ignore_eos`` keeps), with its text left out (``LLMEngine._apply``'s rule)."""
        if c.finish_reason != "stop" or params.include_stop_str_in_output:
            return False
        return isinstance(c.stop_reason, int) or (not params.ignore_eos and token in self.eos_token_ids)
