"""``LLM``: offline batch generation, shaped like vLLM's."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Callable, Sequence

import attrs
from tqdm import tqdm

from vtcore.engine.arg_utils import engine_config
from vtcore.engine.front_end import EngineFrontEnd, refuse_lora
from vtcore.engine.llm_engine import LLMEngine, Prompt
from vtcore.errors import EngineDeadError, NotSupportedError
from vtcore.outputs import RequestOutput
from vtcore.sampling_params import RequestOutputKind, SamplingParams


class LLM(EngineFrontEnd):
    """``LLM(model=PATH or HUB_ID, device=..., dtype=..., **knobs)``; with no model, the embedded default. The
    front-end methods (``tokenize``, ``limits``, ``stats``, ...) come from ``EngineFrontEnd``."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine = LLMEngine(engine_config("LLM", model, kwargs))
        self._counter = 0
        self._shut_down = False

    @property
    def llm_engine(self) -> LLMEngine:
        """vLLM's name for the engine (``engine``)."""
        return self.engine

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block, so later prompts recompute their prefixes (as vLLM's); True
        when prefix caching is on."""
        return self.engine.reset_prefix_cache()

    def start_profile(self) -> None:
        """Record what the engine does from now on with torch.profiler (vLLM's; the engine needs
        ``profiler_config``); ``stop_profile`` writes the trace."""
        self.engine.start_profile()

    def stop_profile(self) -> str:
        """End the recording; returns the trace file's path (in ``profiler_config``'s ``torch_profiler_dir``)."""
        return self.engine.stop_profile()

    def shutdown(self) -> None:
        """Stop the engine's threads and tensor-parallel worker processes (also done at interpreter exit); later
        calls of ``generate`` raise ``EngineDeadError``."""
        self._shut_down = True
        self.engine.shutdown()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | Callable[..., Any] = True, *, priority: Sequence[int] | None = None,
                 lora_request: Any = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order.

        ``use_tqdm`` (vLLM's): a progress bar of finished prompts on stderr, or none (False), or one made by
        this callable (as vLLM calls it: tqdm's ``total``, ``desc`` and ``dynamic_ncols``; then ``update(n)`` and
        ``close()``).
        Every prompt is validated before any runs, so a bad one raises without leaving work behind.
        ``priority`` (vLLM's): one per prompt, for ``scheduling_policy="priority"`` (lower first).
        ``lora_request`` (vLLM's) must be None: no adapters.
        """
        if self._shut_down:
            raise EngineDeadError("the engine is shut down")
        refuse_lora(lora_request)
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, Sequence):
            raise ValueError(f"prompts={prompts!r}: expected a prompt (a string or a dict) or a list of them")
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        elif not isinstance(sampling_params, Sequence) or isinstance(sampling_params, str):
            raise ValueError(f"sampling_params={sampling_params!r}: expected a SamplingParams, one per prompt, or "
                             "None (the checkpoint's generation_config.json values)")
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params has {len(params)} entries, expected one per prompt "
                                 f"({len(prompts)}) or a single SamplingParams")
        # Offline, only the final output is returned (vLLM's LLM does the same): a DELTA request would
        # return its last piece only, and CUMULATIVE ones would build an output every step.
        final_only = {id(p): attrs.evolve(p, output_kind=RequestOutputKind.FINAL_ONLY)
                      for p in params if isinstance(p, SamplingParams)}  # once per distinct object
        params = [final_only.get(id(p), p) for p in params]
        if priority is not None and (isinstance(priority, (str, bytes)) or not isinstance(priority, Iterable)):
            raise ValueError(f"priority={priority!r}: expected a list of one integer per prompt")
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"priority has {len(priorities)} entries, expected one per prompt ({len(prompts)})")
        engine = self.engine
        ids = []
        # (made before any request is added: a factory that fails leaves nothing behind)
        bar = use_tqdm(total=len(prompts), desc="Processed prompts", dynamic_ncols=True) if callable(use_tqdm) \
            else tqdm(total=len(prompts), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        try:
            for prompt, p, rank in zip(prompts, params, priorities):
                ids.append(str(self._counter))
                self._counter += 1
                engine.add_request(ids[-1], prompt, p, rank)
        except Exception:
            for rid in ids[:-1]:
                engine.drop_request(rid)
            bar.close()
            raise
        final: dict[str, RequestOutput] = {}
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        final[out.request_id] = out
                        bar.update(1)
        except BaseException:  # a failed step (or bar): drop this call's requests, keep the engine usable
            for rid in ids:
                engine.abort_request(rid)
            while engine.has_unfinished_requests():
                engine.step()
            raise
        finally:
            bar.close()
        return [final[rid] for rid in ids]

    def chat(self, messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | Callable[..., Any] = True, lora_request: Any = None, chat_template: str | None = None,
             chat_template_content_format: str = "auto", add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             mm_processor_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Render each conversation through the chat template (the tokenizer's, or ``chat_template``; the
        switches and ``tools`` as vLLM's ``LLM.chat`` and :meth:`chat_prompt` take them) and generate. As in
        vLLM, ``chat_template_kwargs`` may also set the two switches, over the arguments. vLLM's order of
        arguments; ``chat_template_content_format`` is "auto" or "string" (a message's text parts are joined into
        one string), ``mm_processor_kwargs`` None (text only)."""
        if chat_template_content_format not in ("auto", "string"):
            raise ValueError(f"chat_template_content_format={chat_template_content_format!r}: expected 'auto' or "
                             "'string' (a message's text parts reach the template as one string)")
        if mm_processor_kwargs:
            raise NotSupportedError(f"mm_processor_kwargs={mm_processor_kwargs!r}: text only; expected None")
        one = not isinstance(messages, (list, tuple)) or not messages or isinstance(messages[0], dict)
        conversations = [messages] if one else list(messages)  # (a string: refused by name, not as its first letter)
        kwargs = {**(chat_template_kwargs or {}), **({"tools": tools} if tools else {})}
        add_generation_prompt = kwargs.pop("add_generation_prompt", add_generation_prompt)
        continue_final_message = kwargs.pop("continue_final_message", continue_final_message)
        prompts = [self.chat_prompt(c, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message, **kwargs)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)
