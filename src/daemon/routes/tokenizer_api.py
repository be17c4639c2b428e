"""vLLM's tokenizer routes: POST /tokenize (a text, or chat messages through the chat template) and POST /detokenize.

The shapes are vLLM's (``serving_tokenization``): ``{model, prompt}`` or ``{model, messages,
add_generation_prompt}`` give ``{count, max_model_len, tokens}`` (and ``token_strs`` when
asked); ``{model, tokens}`` gives ``{prompt}``. They use the LLM engine's own tokenizer, so
the ids are those its completions take and its usage counts.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from headrace.daemon import bodies as rq
from headrace.daemon import structured
from headrace.daemon.routes.openai_api import check_vocab, engine_for, no_template_is_400
from headrace.daemon.openai_schemas import DetokenizeRequest, TokenizeChatRequest, TokenizeRequest
from headrace.daemon.services import daemon


async def tokenize(request: Request) -> Response:
    raw = await rq.read_json(request, daemon(request).config.server.max_body_bytes)
    # vLLM tells the two bodies apart the same way: chat ones carry messages.
    body = rq.validate(TokenizeChatRequest if "messages" in raw else TokenizeRequest, raw)
    slot = engine_for(request, body.model, "llm", "tokenization")
    engine = slot.engine
    if isinstance(body, TokenizeChatRequest):
        messages = structured.chat_messages(body)
        size = sum(len(m.get("content") or "") for m in messages)
        with no_template_is_400():
            tokens = await rq.off_loop_if_large(size, engine.chat_tokens, messages, None,
                                                   body.add_generation_prompt)
    elif body.add_special_tokens:
        tokens = await rq.off_loop_if_large(len(body.prompt), engine.prompt_tokens, body.prompt)
    else:
        tokens = await rq.off_loop_if_large(len(body.prompt), engine.encode, body.prompt)
    tokens = list(tokens)  # a text with add_special_tokens (vLLM's default): as /v1/completions takes it
    out: dict[str, Any] = {"count": len(tokens), "max_model_len": engine.max_context_tokens, "tokens": tokens}
    if body.return_token_strs:
        out["token_strs"] = engine.tokenizer.convert_ids_to_tokens(tokens)
    return JSONResponse(out)


async def detokenize(request: Request) -> Response:
    raw = await rq.read_json(request, daemon(request).config.server.max_body_bytes)
    body = rq.validate(DetokenizeRequest, raw)
    slot = engine_for(request, body.model, "llm", "detokenization")
    check_vocab(slot, body.tokens, "tokens")
    # As vLLM decodes a prompt: special tokens spelled out, so a chat template's ids round-trip.
    text = await rq.off_loop_if_large(len(body.tokens), slot.engine.tokenizer.decode, body.tokens)
    return JSONResponse({"prompt": text})
