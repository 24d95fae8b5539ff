"""Refusals answered in Serve's HTTP proxy: from admission's board, and while admission's gate is shut.

First the board (`cluster/admission_board.py`): while every ingress on the proxy's node posts that admission
refuses any request now, the proxy refuses a request to the OpenAI routes itself (without SLO headers of its
own, with the right API key), with the posted status, `Retry-After` and message. What the board does not
answer falls back to the replay below.

Under overload most requests are refused (`cluster/admission.py`), and each
refusal that reaches the ingress crosses the proxy -> ingress hop twice. On the
2-core CPU host that hop set the refusals' tail (p99 52-83 ms against a 12 ms
median at 2-4x the sustainable rate). The ingress marks a refusal made while
its gate is shut with `GATE_HEADER` (how long the gate stays shut, in ms). The
proxy then answers the next requests to the OpenAI routes itself, replaying
that refusal (status, headers, OpenAI error body), for at most `window_s`. It
keeps no state of its own beyond that: the gate reopens in the ingress when a
request completes, and the proxy learns it from the next request that it
forwards.

Serve installs the middleware from `RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`
(`cluster/serve_env.py` sets it to `proxy_middlewares` here).
"""

from __future__ import annotations

import json
import time

from cluster.admission_board import Boards
from replicas.openai_api import error_reply

GATE_HEADER = "x-forespark-gate-ms"
ANSWERED_HEADER = "x-forespark-refused-by"  # "proxy" on the refusals replayed here (`forespark overload` splits their times)
GATED_PATHS = ("/v1/completions", "/v1/chat/completions")
WINDOW_S = 0.1
SLO_HEADERS = (b"x-slo-ttft-ms", b"x-slo-tpot-ms")  # (`cluster.admission.TTFT_HEADER`, `TPOT_HEADER`)


class ProxyGate:
    """Pure ASGI middleware (streamed responses pass through untouched)."""

    def __init__(self, app, window_s: float = WINDOW_S, boards: Boards | None = None) -> None:
        self.app = app
        self.window_s = window_s
        self.boards = Boards() if boards is None else boards
        self.closed_until = 0.0
        self._refusal: tuple[dict, bytes] | None = None  # the ingress's last gated refusal: start message, body
        self.answered = 0  # refusals answered here

    async def __call__(self, scope, receive, send) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST" or scope.get("path") not in GATED_PATHS:
            await self.app(scope, receive, send)
            return
        if await self._answer_from_board(scope, send):
            return
        if self._refusal is not None and time.monotonic() < self.closed_until:
            start, body = self._refusal
            self.answered += 1
            await send({**start, "headers": [*(start.get("headers") or ()), (ANSWERED_HEADER.encode(), b"proxy")]})
            await send({"type": "http.response.body", "body": body, "more_body": False})
            return
        await self.app(scope, receive, self._watching(send))

    async def _answer_from_board(self, scope, send) -> bool:
        headers = dict(scope.get("headers") or ())
        if any(h in headers for h in SLO_HEADERS):
            return False
        authorization = headers.get(b"authorization")
        refusal = self.boards.refusal(None if authorization is None else authorization.decode(errors="replace"))
        if refusal is None:
            return False
        self.answered += 1
        error_type = "RateLimitError" if refusal.status == 429 else "ServiceUnavailableError"
        body = json.dumps(error_reply(refusal.status, refusal.message, error_type).body).encode()
        await send({"type": "http.response.start", "status": refusal.status, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"retry-after", str(refusal.retry_after_s).encode()), (ANSWERED_HEADER.encode(), b"proxy")]})
        await send({"type": "http.response.body", "body": body, "more_body": False})
        return True

    def _watching(self, send):
        gated: dict | None = None

        async def watch(message) -> None:
            nonlocal gated
            if message["type"] == "http.response.start" and message.get("status", 200) >= 400:
                for key, value in message.get("headers") or ():
                    if key.lower() == GATE_HEADER.encode():
                        self.closed_until = time.monotonic() + min(float(value) / 1000.0, self.window_s)
                        gated = message
            elif gated is not None and message["type"] == "http.response.body" and not message.get("more_body"):
                self._refusal = (gated, message.get("body", b""))
            await send(message)

        return watch


def proxy_middlewares() -> list:
    """Serve's proxy callback (`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`)."""
    from starlette.middleware import Middleware

    return [Middleware(ProxyGate)]
