"""Every error the server answers is OpenAI's error object: {"error": {"message", "type", "param", "code"}}.

A route raises `APIError`; FastAPI's own refusals (a body that fails validation, an unknown path, a wrong method)
and any bug are turned into the same object here, so a client never gets a bare text or FastAPI's `detail` shape.
Client errors and 503s are counted on /metrics (`ServerMetrics.rejected`).
"""
from __future__ import annotations

import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lab_utils.server.messages import ROLES


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 headers: dict[str, str] | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.headers = status, message, kind, param, headers
        self.code = code


def error_response(request: Request, status: int, message: str, kind: str, param: str | None = None,
                   headers: dict[str, str] | None = None, code: str | None = None) -> JSONResponse:
    """The error object, counted on the app's metrics when it is the client's (4xx) or a 503."""
    if status < 500 or status == 503:
        request.app.state.metrics.rejected(status)
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


async def api_error(request: Request, exc: APIError) -> JSONResponse:
    return error_response(request, exc.status, exc.message, exc.kind, exc.param, exc.headers, exc.code)


async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """404 unknown path, 405 wrong method, 400 a body that could not be parsed at all, ..."""
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    why = {404: f"{request.url.path} is not an endpoint of this server (see /docs)",
           405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
    if exc.status_code == 400:  # the body could not be parsed at all (not UTF-8, nested too deep, ...)
        why += "; send a JSON object as the body (Content-Type: application/json)"
    return error_response(request, exc.status_code, why, kind, None, dict(exc.headers or {}) or None)


async def unexpected(request: Request, exc: Exception) -> JSONResponse:
    """A bug: still OpenAI's error object, never a bare text."""
    return error_response(request, 500, f"the server failed on this request ({type(exc).__name__}: {exc})",
                          "server_error")


async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    """A body that fails validation: one message naming every bad field, `param` the first of them."""
    parts, params = [], []
    for e in exc.errors():
        where = _where(e.get("loc", []))
        if e.get("type") == "json_invalid":
            where = ""  # the body itself: loc holds the character position
        params.append(where or None)
        parts.append(f"{where or 'body'}: {e.get('msg')}")
    if any(e.get("type") == "json_invalid" or not _where(e.get("loc", [])) for e in exc.errors()):
        parts.append("send a JSON object as the body (Content-Type: application/json)")
    return error_response(request, 400, "; ".join(dict.fromkeys(parts)) or "invalid request", "invalid_request_error",
                          params[0] if params else None)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)
    app.add_exception_handler(RequestValidationError, bad_request)


_FIELD = re.compile(r"^[a-z_][a-z0-9_]*$")
_TYPE_TAGS = {"int", "str", "float", "bool", "none", "dict", "list"}


def _where(loc) -> str:
    """A validation error's place as fields and indices (`messages.0.content`): the tags pydantic adds for a
    union's member (`constrained-str`, `list[int]`, a model's class name, a message's role) and dict keys left
    out, so `param` names a field of the request."""
    out = []
    for i, x in enumerate(loc):
        if isinstance(x, int):
            out.append(str(x))
        elif i == 0 and x == "body" or not _FIELD.match(x) or x in _TYPE_TAGS:
            continue
        elif x in ROLES and i and isinstance(loc[i - 1], int):
            continue  # messages.<i>.<role tag>
        else:
            out.append(x)
    return ".".join(out)
