"""POST /v1/completions, POST /v1/chat/completions and GET /v1/models."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.responses import Response

from llmsched.server.errors import APIError
from llmsched.server.generation import generate
from llmsched.server.media import extract_images
from llmsched.server.prompts import chat_prompt_ids, completion_prompt_ids
from llmsched.server.protocol import ChatCompletionRequest, CompletionRequest
from llmsched.server.responses import ChatFormatter, CompletionFormatter
from llmsched.server.sampling import (
    build_sampling_params,
    check_chat,
    check_completion,
    check_prompt_len,
    prompt_logprobs_of,
    resolve_max_tokens,
    structured_outputs_for,
)
from llmsched.server.state import ServerState
from llmsched.server.tool_calls import plan_tools
from llmsched.server.tool_responses import ToolChatFormatter

_ERRORS = {
    400: {"description": "Invalid parameters or prompt (OpenAI error shape)"},
    401: {"description": "Missing or wrong API key"},
    404: {"description": "Unknown model"},
    503: {"description": "Overloaded; retry after the Retry-After header's seconds"},
}


def openai_router(state: ServerState) -> APIRouter:
    """The OpenAI-compatible routes over ``state``."""
    router = APIRouter()

    @router.get("/v1/models")
    async def list_models() -> dict:
        """The served model, under each of its names, then each loaded LoRA adapter."""
        entries = [(name, state.model_root, None) for name in state.served_model_names]
        if state.loras is not None:
            entries += [(lr.lora_name, lr.lora_path, state.model_name) for lr in state.loras.all()]
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": state.created,
                    "owned_by": "llmsched",
                    "root": root,
                    "parent": parent,
                    "max_model_len": state.limits.max_model_len,
                }
                for name, root, parent in entries
            ],
        }

    @router.post("/v1/completions", responses=_ERRORS)  # type: ignore[arg-type]
    async def create_completion(body: CompletionRequest) -> Response:
        """Complete a prompt (text or token ids); SSE when ``stream`` is true."""
        state.check_model(body.model)
        check_completion(body)
        ids = completion_prompt_ids(body.prompt, state.tokenizer, state.vocab_size)
        check_prompt_len(len(ids), state.limits, "prompt")
        # As vLLM: echo with max_tokens 0 still samples one token, then shows only the prompt.
        echo_only = bool(body.echo) and body.max_tokens == 0
        requested = 1 if echo_only else body.max_tokens
        max_tokens = resolve_max_tokens(requested, len(ids), state.limits, "max_tokens")
        prompt_lps = prompt_logprobs_of(body, state.limits.max_logprobs)
        if prompt_lps is None and body.echo:
            prompt_lps = body.logprobs
        params = build_sampling_params(
            body,
            max_tokens=max_tokens,
            logprobs=body.logprobs,
            limits=state.limits,
            structured_outputs=structured_outputs_for(body),
            prompt_logprobs=prompt_lps,
        )
        rid = state.engine.new_request_id("cmpl")
        fmt = CompletionFormatter(rid, state.response_model(body.model), len(ids), body.logprobs)
        fmt.echo_only = echo_only
        if body.echo and body.logprobs is not None:
            fmt.echo_ids = list(ids)
        if state.tokenizer is not None:
            tok = state.tokenizer
            fmt.decode_token = lambda t: tok.decode([t], skip_special_tokens=False)
        return await generate(state, rid, ids, params, body, fmt, "prompt")

    @router.post("/v1/chat/completions", responses=_ERRORS)  # type: ignore[arg-type]
    async def create_chat_completion(body: ChatCompletionRequest) -> Response:
        """Answer a chat, rendered with the model's chat template; SSE when ``stream`` is true."""
        state.check_model(body.model)
        check_chat(body)
        if body.continue_final_message:
            raise APIError(400, "continue_final_message is not supported", "continue_final_message")
        plan = plan_tools(body.tools, body.tool_choice)
        constraint = structured_outputs_for(body, plan.schema if plan is not None else None)
        messages, images = extract_images(
            body.messages, state.image_placeholder, state.args.allowed_media_domains
        )
        ids = chat_prompt_ids(
            messages,
            state.tokenizer,
            add_generation_prompt=body.add_generation_prompt,
            template_kwargs=body.chat_template_kwargs,
            tools=plan.tools if plan is not None else None,
        )
        # Each image's placeholder becomes its image tokens in the engine.
        prompt_len = len(ids) + len(images) * (state.image_tokens - 1)
        check_prompt_len(prompt_len, state.limits, "messages")
        if body.max_completion_tokens is not None:
            requested, param = body.max_completion_tokens, "max_completion_tokens"
        else:
            requested, param = body.max_tokens, "max_tokens"
        max_tokens = resolve_max_tokens(requested, prompt_len, state.limits, param)
        num_top = (body.top_logprobs or 0) if body.logprobs else None
        params = build_sampling_params(
            body,
            max_tokens=max_tokens,
            logprobs=num_top,
            limits=state.limits,
            structured_outputs=constraint,
            prompt_logprobs=prompt_logprobs_of(body, state.limits.max_logprobs),
        )
        rid = state.engine.new_request_id("chatcmpl")
        name = state.response_model(body.model)
        if plan is None:
            fmt = ChatFormatter(rid, name, prompt_len, num_top)
        else:
            fmt = ToolChatFormatter(rid, name, prompt_len, num_top, plan)
        return await generate(state, rid, ids, params, body, fmt, "messages", images or None)

    return router
