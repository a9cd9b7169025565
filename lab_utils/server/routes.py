"""The endpoints: /health, /metrics, /v1/models, /v1/completions, /v1/chat/completions.

Each route receives the app's `ServedModels` as a dependency; a generation request's `model` picks the
`Frontend` (that model's engine and settings) that checks it (after its body's model, schemas.py) before
anything reaches the engine, and answers it.
"""
from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from lab_utils.server.errors import APIError
from lab_utils.server.messages import ConversationError, check_conversation, for_template, size_of
from lab_utils.server.metrics import render_all
from lab_utils.server.models import ServedModels
from lab_utils.server.responses import complete
from lab_utils.server.schemas import ChatRequest, CompletionRequest
from lab_utils.server.tools import ToolRequestError, render_chat, tool_mode


def served_models(request: Request) -> ServedModels:
    return request.app.state.models


Models = Annotated[ServedModels, Depends(served_models)]
router = APIRouter()


@router.get("/health")
async def health(served: Models):
    """500 while any model's engine is unusable (the others still answer their requests)."""
    dead = served.dead()
    if dead:
        one = len(served.names) == 1
        why = "; ".join(f"{'' if one else f'model {name!r}: '}engine failed: {err}" for name, err in dead.items())
        return JSONResponse({"error": {"message": why, "type": "server_error", "param": None, "code": None}},
                            status_code=500)
    return {"status": "ok"}


@router.get("/metrics")
async def prom(served: Models):
    return Response(render_all({fe.model_name: fe.metrics for fe in served}),
                    media_type="text/plain; version=0.0.4")


@router.get("/v1/models")
async def models(served: Models):
    return served.listing()


@router.post("/v1/completions")
async def completions(req: CompletionRequest, raw: Request, served: Models):
    fe = served.pick(req.model)
    params = fe.to_params(req, req.max_tokens, await fe.constraint(req))
    prompts = req.prompts()  # n choices each, in order
    ids = [await fe.token_ids(p, "prompt") for p in prompts]
    echo = [p if isinstance(p, str) else fe.prompt_text(i) for p, i in zip(prompts, ids)] if req.echo else None
    return await complete(fe, raw, ids, params, "text", req, "prompt", echo=echo, n=req.n)


@router.post("/v1/chat/completions")
async def chat(req: ChatRequest, raw: Request, served: Models):
    fe = served.pick(req.model)
    try:
        mode = tool_mode(req.tools, req.tool_choice)  # None | "auto" | "required" | "function:<name>"
    except ToolRequestError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    try:
        check_conversation(req.messages)  # each tool message answers a call made just before it
    except ConversationError as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    params = fe.to_params(req, req.max_completion_tokens or req.max_tokens, await fe.constraint(req, mode))
    msgs = for_template(req.messages)
    try:  # tools shown to the model; a long conversation is rendered in a worker thread
        prompt = await fe.offload.run(render_chat, fe.tokenizer, msgs, req.tools, mode, size=size_of(msgs))
    except Exception as exc:  # noqa: BLE001 - a template that refuses these messages is the client's problem
        raise APIError(400, f"the chat template refused these messages ({type(exc).__name__}: {exc}); check "
                            f"the roles' order and the contents' text", param="messages") from None
    return await complete(fe, raw, [await fe.token_ids(prompt, "messages")], params, "chat", req, "messages",
                          mode, req.tools)
