"""POST /tokenize and /detokenize, shaped as vLLM's: prompts or chat messages to ids and back."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import Field

from llmsched.engine.tokenizer import Tokenizer
from llmsched.server.errors import APIError
from llmsched.server.prompts import NO_TOKENIZER, chat_prompt_ids, check_token_ids, encode
from llmsched.server.protocol import ChatMessage, _Body
from llmsched.server.state import ServerState


class TokenizeCompletionBody(_Body):
    """/tokenize with a text prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatBody(_Body):
    """/tokenize with chat messages, rendered with the model's chat template."""

    model: str | None = None
    messages: list[ChatMessage] = Field(..., min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeBody(_Body):
    """/detokenize."""

    model: str | None = None
    tokens: list[int]


def require_tokenizer(state: ServerState, route: str) -> Tokenizer:
    """The server's tokenizer; 400 when it runs on token ids alone."""
    if state.tokenizer is None:
        raise APIError(400, f"{route} {NO_TOKENIZER}")
    return state.tokenizer


def tokenize_router(state: ServerState) -> APIRouter:
    """The tokenizer routes over ``state``."""
    router = APIRouter()

    @router.post("/tokenize")
    async def tokenize(body: TokenizeChatBody | TokenizeCompletionBody) -> dict:
        """Token ids of a prompt, or of chat messages after the chat template."""
        state.check_model(body.model)
        tok = require_tokenizer(state, "/tokenize")
        if isinstance(body, TokenizeChatBody):
            if body.continue_final_message and body.add_generation_prompt:
                raise APIError(
                    400,
                    "continue_final_message and add_generation_prompt cannot both be true",
                    "continue_final_message",
                )
            ids = chat_prompt_ids(
                body.messages,
                tok,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                template_kwargs=body.chat_template_kwargs,
                add_special_tokens=body.add_special_tokens,
            )
        else:
            ids = encode(tok, body.prompt, add_special_tokens=body.add_special_tokens, param="prompt")
        out: dict[str, Any] = {
            "count": len(ids),
            "max_model_len": state.limits.max_model_len,
            "tokens": ids,
            "token_strs": None,
        }
        if body.return_token_strs:
            out["token_strs"] = [tok.id_to_token(t) for t in ids]
        return out

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeBody) -> dict:
        """The text of token ids (special tokens kept, as vLLM's /detokenize keeps them)."""
        state.check_model(body.model)
        tok = require_tokenizer(state, "/detokenize")
        check_token_ids(body.tokens, state.vocab_size, "tokens")
        return {"prompt": tok.decode(body.tokens, skip_special_tokens=False)}

    return router
