"""Limits on how a request arrives, enforced while it is read, before the app or the API key check sees
anything: its head (request line + headers) at most `MAX_HEADER_BYTES` (else 431) within `HEADER_TIMEOUT_S`
from its first byte (else 408), and its whole body within `BODY_TIMEOUT_S` of the head's end (else 408, and the
connection is closed). Without them a client can hold a connection open with a header or a body that never ends
(a byte every few seconds: "slow POST"), and enough such clients use up the server's file descriptors.
uvicorn itself times out neither. Malformed HTTP gets OpenAI's error object too (uvicorn's own answer is plain
text).

`GuardedHttpTools` is uvicorn's httptools protocol with these checks: `uvicorn.Config(app, http=GuardedHttpTools)`.
"""
from __future__ import annotations

import json

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

MAX_HEADER_BYTES = 64 * 1024  # a real client sends < 2 kB; vLLM's server (h11) allows 64 kB
HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 30.0  # the largest body (1 MiB by default) in 30 s is 35 kB/s: any real client is faster

REASONS = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


def error_response(status: int, message: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": None}}).encode()
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            % (status, REASONS[status], len(body))) + body


class GuardedHttpTools(HttpToolsProtocol):
    max_header_bytes = MAX_HEADER_BYTES
    header_timeout_s = HEADER_TIMEOUT_S
    body_timeout_s = BODY_TIMEOUT_S

    def connection_made(self, transport) -> None:
        self._body_timer = None
        super().connection_made(transport)
        self._head_bytes = 0
        self._in_head = True  # reading a request's head (the connection's first, or the next on keep-alive)
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_too_slow)

    def data_received(self, data: bytes) -> None:
        if self._in_head and self._head_timer is None:  # first bytes of the next request on this connection
            self._head_bytes = 0
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_too_slow)
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        # still in the head after parsing: every byte so far is request line and headers
        if self._in_head and self._head_bytes > self.max_header_bytes and not self.transport.is_closing():
            self._refuse(431, f"the request's headers are larger than this server's limit of "
                              f"{self.max_header_bytes} bytes: send fewer or shorter headers")

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._stop_timer()
        super().on_headers_complete()
        self._stop_body_timer()
        self._body_timer = self.loop.call_later(self.body_timeout_s, self._body_too_slow)

    def on_message_complete(self) -> None:
        self._stop_body_timer()  # the whole body is in
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._in_head = True  # the next request's head; its timer starts with its first byte

    def connection_lost(self, exc) -> None:
        self._stop_timer()
        self._stop_body_timer()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        self._stop_timer()
        self.transport.write(error_response(400, f"{msg} (not parsable as HTTP/1.1)"))
        self.transport.close()

    def _stop_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _stop_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _body_too_slow(self) -> None:
        """The body is still arriving at its deadline: 408 (if nothing was answered yet) and the connection
        closed; the app, waiting for the rest of the body, sees the client gone."""
        self._body_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_started:
            self._refuse(408, f"the request's body did not arrive within {self.body_timeout_s:g} s of its headers")
        else:
            self.transport.close()

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if self._in_head and self._head_bytes and not self.transport.is_closing():
            self._refuse(408, f"the request's headers did not arrive within {self.header_timeout_s:g} s")
        elif self._in_head and not self.transport.is_closing() and self.cycle is None:
            self.transport.close()  # connected and silent: nothing to answer

    def _refuse(self, status: int, message: str) -> None:
        self._stop_timer()
        self._stop_body_timer()
        self.transport.write(error_response(status, message))
        self.transport.close()
