"""The endpoints: /health, /metrics, /v1/models, /v1/completions, /v1/chat/completions.

Each route receives the app's `Frontend` (the engine and the settings) as a dependency; the request bodies are
checked by their models (schemas.py) and by the frontend before anything reaches the engine.
"""
from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from lab_utils.server.errors import APIError
from lab_utils.server.frontend import Frontend
from lab_utils.server.messages import ConversationError, check_conversation, for_template, size_of
from lab_utils.server.responses import complete
from lab_utils.server.schemas import ChatRequest, CompletionRequest
from lab_utils.server.tools import ToolRequestError, render_chat, tool_mode


def frontend(request: Request) -> Frontend:
    return request.app.state.frontend


Front = Annotated[Frontend, Depends(frontend)]
router = APIRouter()


@router.get("/health")
async def health(fe: Front):
    if fe.aengine.error is not None:
        return JSONResponse({"error": {"message": f"engine failed: {fe.aengine.error}", "type": "server_error",
                                       "param": None, "code": None}}, status_code=500)
    return {"status": "ok"}


@router.get("/metrics")
async def prom(fe: Front):
    return Response(fe.metrics.render(), media_type="text/plain; version=0.0.4")


@router.get("/v1/models")
async def models(fe: Front):
    return {"object": "list", "data": [{"id": fe.model_name, "object": "model", "owned_by": "lab_utils",
                                        "max_model_len": fe.engine.max_model_len}]}


@router.post("/v1/completions")
async def completions(req: CompletionRequest, raw: Request, fe: Front):
    fe.check_model(req.model)
    params = fe.to_params(req, req.max_tokens, await fe.constraint(req))
    ids = await fe.token_ids(req.prompt, "prompt")
    echo = (req.prompt if isinstance(req.prompt, str) else fe.prompt_text(ids)) if req.echo else None
    return await complete(fe, raw, ids, params, "text", req, "prompt", echo=echo)


@router.post("/v1/chat/completions")
async def chat(req: ChatRequest, raw: Request, fe: Front):
    fe.check_model(req.model)
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
    return await complete(fe, raw, await fe.token_ids(prompt, "messages"), params, "chat", req, "messages",
                          mode, req.tools)
