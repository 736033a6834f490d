"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: the token ids the generation endpoints would
take from a prompt or a conversation, and the text of token ids."""
from __future__ import annotations

from vtcore.server.chat import check_switches, render_chat
from vtcore.server.errors import APIError
from vtcore.server.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from vtcore.server.serving import Serving


class Tokenization:
    """Both endpoints; they run on a preparing thread (a large text takes a while)."""

    def __init__(self, serving: Serving) -> None:
        self.serving = serving
        self.engine = serving.engine

    async def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        return await self.serving.off_loop(self._tokenize, body)

    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        return await self.serving.off_loop(self._detokenize, body)

    def _tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        self.serving.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "prompt, messages: expected one of them (a text, or a conversation)", "prompt")
        if body.tools is not None and body.messages is None:
            raise APIError(400, "tools: rendered with messages only; expected messages, or no tools", "tools")
        check_switches(body.add_generation_prompt, body.continue_final_message)
        if body.messages is not None:
            if body.add_special_tokens:
                raise APIError(400, "add_special_tokens=true with messages: a conversation's special tokens are the "
                                    "chat template's; expected false or none", "add_special_tokens")
            ids = render_chat(self.engine, body.messages, body.chat_template_kwargs, body.tools,
                              chat_template=self.serving.chat_template,
                              add_generation_prompt=body.add_generation_prompt,
                              continue_final_message=body.continue_final_message)["prompt_token_ids"]
        else:
            try:
                ids = self.engine.tokenize(body.prompt, body.add_special_tokens is not False)[1]
            except ValueError as exc:
                raise APIError(400, f"prompt: {exc}", "prompt") from None
        strs = self.engine.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.serving.limits.max_model_len, tokens=ids,
                                token_strs=strs)

    def _detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        self.serving.check_model(body.model)
        try:
            return DetokenizeResponse(prompt=self.engine.detokenize(body.tokens))
        except ValueError as exc:
            raise APIError(400, f"tokens: {exc}", "tokens") from None
