"""The server's gate, as plain ASGI: the API key (compared in constant time) and a bound on the request body.

Both are checked before any endpoint runs, so a stranger or an oversized body costs nothing beyond reading
at most `max_body_bytes`. A pure ASGI middleware (not Starlette's BaseHTTPMiddleware) leaves streaming
responses and client-disconnect detection as they are.
"""
from __future__ import annotations

import hmac
import json
import os
from collections.abc import Callable
from pathlib import Path

DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: a full 8k-token prompt as ids is ~60 kB of JSON


def error_body(status: int, message: str, kind: str, param: str | None = None) -> bytes:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": None}}).encode()


ERROR_SCHEMA = {  # the OpenAPI description of `error_body` (and of every error this server answers)
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"], "description": "the request field at fault, or null"},
        "code": {"type": ["string", "null"], "description": "a machine-readable reason, or null"}}}}}


def document_errors(spec: dict, statuses: dict[str, list[int]]) -> dict:
    """FastAPI's OpenAPI `spec` with the errors this server really answers: OpenAI's error object for each status
    in `statuses[path]` (FastAPI's own 422 and its validation-error schemas dropped: a bad body is a 400 here)."""
    spec.setdefault("components", {}).setdefault("schemas", {})["ErrorResponse"] = ERROR_SCHEMA
    for name in ("HTTPValidationError", "ValidationError"):
        spec["components"]["schemas"].pop(name, None)
    ref = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    for path, operations in spec.get("paths", {}).items():
        for op in operations.values():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            for status in statuses.get(path, []):
                responses[str(status)] = {"description": HTTP_REASONS.get(status, "error"), "content": ref}
    return spec


HTTP_REASONS = {400: "bad request (the message names the field)", 401: "missing or wrong API key",
                404: "unknown model or path", 408: "the request's headers took too long",
                413: "body too large", 431: "the request's headers are too large",
                500: "the engine failed on this request", 503: "queue full (Retry-After) or engine unusable"}


def key_matches(header: bytes, api_key: str) -> bool:
    """`Authorization: Bearer <key>`, compared with hmac.compare_digest (time does not depend on where they differ)."""
    return hmac.compare_digest(header, b"Bearer " + api_key.encode())


class KeyFile:
    """API keys in a file, one per line: the key, then optionally who holds it (`KEY NAME`; a workshop's
    `api_keys.txt`). Read again whenever the file changes, so keys added while the server runs are taken at
    once and a key removed from the file stops working; a file that vanishes accepts no key."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ValueError(f"--api-key-file {self.path}: no such file (one key per line, 'KEY NAME')")
        self._seen: tuple[int, int] | None = None
        self._keys: list[str] = []

    def keys(self) -> list[str]:
        try:
            st = self.path.stat()
        except OSError:
            return []
        if (st.st_mtime_ns, st.st_size) != self._seen:
            lines = self.path.read_text(encoding="utf-8").splitlines()
            self._keys = [line.split()[0] for line in lines if line.strip() and not line.lstrip().startswith("#")]
            self._seen = (st.st_mtime_ns, st.st_size)
        return self._keys

    def matches(self, header: bytes) -> bool:
        return any([key_matches(header, k) for k in self.keys()])  # every key compared: no early exit


class RequestGuard:
    def __init__(self, app, api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 on_reject: Callable[[int], None] | None = None, api_key_file: KeyFile | None = None) -> None:
        self.app, self.api_key, self.max_body_bytes, self.on_reject = app, api_key, max_body_bytes, on_reject
        self.key_file = api_key_file

    def authorized(self, header: bytes) -> bool:
        """Without a key or a key file, anyone; else the key (`--api-key`) or any key in the file."""
        if not self.api_key and self.key_file is None:
            return True
        return bool(self.api_key and key_matches(header, self.api_key)) or (
            self.key_file is not None and self.key_file.matches(header))

    async def _reply(self, send, status: int, message: str, kind: str, headers: list | None = None) -> None:
        if self.on_reject is not None:
            self.on_reject(status)
        body = error_body(status, message, kind)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                *(headers or [])]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if scope["path"].startswith("/v1/"):
            if not self.authorized(headers.get(b"authorization", b"")):
                return await self._reply(send, 401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                         "authentication_error", [(b"www-authenticate", b"Bearer")])
        too_big = (f"the request body is larger than this server's limit of {self.max_body_bytes} bytes "
                   f"(--max-body-bytes): send a shorter prompt")
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            return await self._reply(send, 413, too_big, "invalid_request_error")
        body, more = b"", True  # read the body here (bounded), then hand it on in one piece
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body_bytes:
                return await self._reply(send, 413, too_big, "invalid_request_error")
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later calls: disconnect detection while streaming

        await self.app(scope, replay, send)
