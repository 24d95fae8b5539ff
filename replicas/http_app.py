"""The OpenAI HTTP surface: OpenAI routes, /health, /metrics, optional API key (FastAPI).

It serves from a `Backend`: one local engine (uvicorn, tests) or the cluster
through Serve deployment handles (`cluster/ingress.py`).

Bad input never reaches the engine as an exception: malformed JSON and
invalid requests get 400 with an OpenAI-style error body, an unknown model
404, and the server keeps serving. A streaming client that disconnects
cancels its generator, which aborts the request in the engine.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from replicas.engine import EngineConfig
from replicas.openai_api import Backend, OpenAIEngine, Reply, error_reply

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


def respond(reply: Reply) -> Response:
    if reply.stream is not None:
        return StreamingResponse(reply.stream, media_type="text/event-stream", headers=reply.headers)
    return JSONResponse(reply.body, status_code=reply.status, headers=reply.headers)


async def _json_body(request: Request) -> dict | Reply:
    try:
        return json.loads(await request.body())
    except (ValueError, UnicodeDecodeError) as e:
        return error_reply(400, f"malformed JSON body: {e}")


def build_http_app(start_backend: Callable[[], Awaitable[Backend]], api_key: str | None = None) -> FastAPI:
    """An app whose lifespan starts its backend with `start_backend` and shuts it down."""
    state: dict[str, Backend] = {}

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        state["engine"] = await start_backend()
        try:
            yield
        finally:
            state.pop("engine").shutdown()

    app = FastAPI(title="ForeSpark serving", lifespan=lifespan)
    if api_key:
        from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

        app.add_middleware(AuthenticationMiddleware, tokens=[api_key])

    async def serve(request: Request, call: Callable[[Backend, dict, Request], Awaitable[Reply]]) -> Response:
        if (refused := state["engine"].refusal_before_body(request.headers)) is not None:
            return respond(refused)
        body = await _json_body(request)
        if isinstance(body, Reply):
            return respond(body)
        return respond(await call(state["engine"], body, request))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, lambda e, b, r: e.completions(b, r))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve(request, lambda e, b, r: e.chat_completions(b, r))

    @app.get("/v1/models")
    async def models() -> Response:
        return respond(await state["engine"].list_models())

    @app.get("/health")
    async def health() -> Response:
        try:
            await state["engine"].check_health()
        except Exception as e:  # the engine is dead: tell the load balancer
            return respond(error_reply(503, f"engine unhealthy: {e}", "ServiceUnavailableError"))
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(await state["engine"].metrics(), media_type=PROMETHEUS_TEXT)

    return app


def engine_app(config: EngineConfig | None = None, api_key: str | None = None, served_model_name: str = "forespark") -> FastAPI:
    """The app for one embedded-default (or given) engine."""
    return build_http_app(lambda: OpenAIEngine.start(config or EngineConfig(), served_model_name), api_key)
