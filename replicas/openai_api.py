"""OpenAI endpoints over one WCS engine (`AsyncLLM`), with vLLM's own OpenAI serving layer.

vLLM's request/response models, validation, sampling defaults and error
mapping are reused as they are (`OpenAIServingCompletion`, `OpenAIServingChat`,
`OpenAIServingModels`); this module only owns the engine's life and turns
every outcome into an HTTP reply: a JSON body with its status, or a stream of
SSE lines ending in `data: [DONE]`. Errors are OpenAI-style
`{"error": {"message", "type", "param", "code"}}` bodies.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Protocol

from pydantic import ValidationError

from replicas.engine import EngineConfig, engine_environment

# The embedded models are plain language models without a chat format: messages are joined.
PLAIN_CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}\n{% endfor %}"


@dataclass
class Reply:
    status: int
    body: dict | None = None  # JSON reply
    stream: AsyncIterator[str] | None = None  # SSE lines ("data: ...\n\n"), ending in "data: [DONE]\n\n"
    headers: dict[str, str] | None = None


class Backend(Protocol):
    """What the HTTP app serves from: one local engine (`OpenAIEngine`) or the cluster (`cluster/ingress.py`)."""

    async def completions(self, body: dict, raw_request=None) -> Reply: ...

    async def chat_completions(self, body: dict, raw_request=None) -> Reply: ...

    def refusal_before_body(self, headers: Mapping[str, str] | None = None) -> Reply | None:
        """A refusal due to a generation request with these headers now, whatever its body (admission's shut gate,
        or no replica that would admit the most favourable body), or None. The app asks before it reads the body:
        behind Serve's proxy that read is one more round trip to the proxy."""

    async def wcs_stats(self) -> dict | None:
        return (await self.engine.collective_rpc("wcs_stats"))[0] if self.has_wcs else None

    async def metrics(self) -> str:
        from replicas.metrics import replica_metrics_text

        return replica_metrics_text(await self.wcs_stats(), None)

    async def list_models(self) -> Reply: ...

    async def check_health(self) -> None: ...

    async def metrics(self) -> str: ...

    def shutdown(self) -> None: ...


def error_reply(
    status: int, message: str, err_type: str = "BadRequestError", param: str | None = None, headers: dict | None = None
) -> Reply:
    return Reply(status, {"error": {"message": message, "type": err_type, "param": param, "code": status}}, headers=headers)


def exception_reply(e: BaseException) -> Reply:
    """The OpenAI error for an exception raised while serving a request, by vLLM's own rule
    (`create_error_response`): its client errors (`VLLMValidationError` with its parameter, not-found,
    unprocessable) and the builtin `ValueError`/`TypeError`/`OverflowError` are the client's fault (4xx),
    anything else is the server's (500).

    vLLM is imported only where it already is (a replica, or an ingress that unpickled a vLLM
    exception): elsewhere the builtin part of the same rule applies, so an ingress never pays
    vLLM's import on its request path."""
    if "vllm.exceptions" in sys.modules:
        from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

        out = create_error_response(e if isinstance(e, Exception) else Exception(str(e)))
        return Reply(out.error.code, out.model_dump())
    if isinstance(e, (ValueError, TypeError, OverflowError)):
        return error_reply(400, str(e))
    return error_reply(500, str(e) or type(e).__name__, "InternalServerError")


class OpenAIEngine:
    """One `AsyncLLM` with WCS and vLLM's completion, chat and model-list handlers over it."""

    def __init__(self, engine, config: EngineConfig, served_model_name: str, cost=None) -> None:
        from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
        from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
        from vllm.entrypoints.openai.models.protocol import BaseModelPath
        from vllm.entrypoints.openai.models.serving import OpenAIServingModels
        from vllm.renderers.online_renderer import OnlineRenderer

        self.engine = engine
        self.config = config
        self.cost = cost  # the profiled StepCostModel (engines with WCS)
        self.served_model_name = served_model_name
        self.models = OpenAIServingModels(
            engine_client=engine, base_model_paths=[BaseModelPath(name=served_model_name, model_path=str(config.model))]
        )
        renderer = OnlineRenderer(
            engine.model_config,
            engine.renderer,
            request_logger=None,
            chat_template=PLAIN_CHAT_TEMPLATE,
            chat_template_content_format="auto",
        )
        self.completion = OpenAIServingCompletion(engine, self.models, online_renderer=renderer, request_logger=None)
        self.chat = OpenAIServingChat(
            engine,
            self.models,
            "assistant",
            online_renderer=renderer,
            request_logger=None,
            chat_template=PLAIN_CHAT_TEMPLATE,
            chat_template_content_format="auto",
        )

    @classmethod
    async def start(cls, config: EngineConfig, served_model_name: str = "forespark", stat_loggers=None) -> "OpenAIEngine":
        """Start the engine (its core in its own process) and, with WCS, load or profile its step cost.

        `stat_loggers`: vLLM stat-logger factories, next to vLLM's own (Prometheus) logger; a
        `PrometheusStatLogger` subclass among them (`RayPrometheusStatLogger` in a Serve replica) replaces it."""
        engine_environment(config)
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        if config.wcs is not None and config.drafter is not None:
            from replicas.wcs.profiler import with_cost_model

            config = with_cost_model(config)
        engine = AsyncLLM.from_engine_args(
            AsyncEngineArgs(**config.vllm_kwargs(), served_model_name=[served_model_name]),
            usage_context=UsageContext.OPENAI_API_SERVER,
            stat_loggers=stat_loggers,
        )
        cost = None
        if config.wcs is not None and config.drafter is not None:
            from replicas.wcs.profiler import ensure_profiled_async

            cost = await ensure_profiled_async(engine, config)
        return cls(engine, config, served_model_name, cost)

    @property
    def has_wcs(self) -> bool:
        return self.cost is not None

    def shutdown(self) -> None:
        self.engine.shutdown()

    async def check_health(self) -> None:
        await self.engine.check_health()

    async def wcs_stats(self) -> dict | None:
        return (await self.engine.collective_rpc("wcs_stats"))[0] if self.has_wcs else None

    async def metrics(self) -> str:
        from replicas.metrics import replica_metrics_text

        return replica_metrics_text(await self.wcs_stats(), None)

    async def list_models(self) -> Reply:
        return Reply(200, (await self.models.show_available_models()).model_dump())

    def refusal_before_body(self, headers: Mapping[str, str] | None = None) -> Reply | None:
        return None  # one engine has no admission

    async def completions(self, body: dict, raw_request=None) -> Reply:
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        return await self._serve(CompletionRequest, self.completion.create_completion, body, raw_request)

    async def chat_completions(self, body: dict, raw_request=None) -> Reply:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        return await self._serve(ChatCompletionRequest, self.chat.create_chat_completion, body, raw_request)

    async def _serve(self, request_type, handler, body: dict, raw_request) -> Reply:
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        if not isinstance(body, dict):
            return error_reply(400, "the request body must be a JSON object")
        try:
            request = request_type.model_validate(body)
        except ValidationError as e:
            first = e.errors()[0]
            param = ".".join(str(x) for x in first.get("loc", ())) or None
            return error_reply(400, f"invalid request: {first.get('msg', e)}", param=param)
        except Exception as e:  # vLLM's own validators raise VLLMValidationError, which pydantic does not wrap
            return exception_reply(e)
        try:
            out = await handler(request, raw_request)
        except Exception as e:  # vLLM raises for engine errors and admission limits; it maps them itself
            return exception_reply(e)
        if isinstance(out, ErrorResponse):
            return Reply(out.error.code, out.model_dump())
        if hasattr(out, "model_dump"):
            return Reply(200, out.model_dump())
        return Reply(200, stream=out)
