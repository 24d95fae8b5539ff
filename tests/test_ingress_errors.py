"""How the ingress reads what a Serve handle raises: the replica's own exception (4xx/500, never retried)
against a failure of Ray or Serve (retry or 503). Real Ray and vLLM exception classes, as the handle
delivers them: a `RayTaskError` that is also an instance of the cause (actor calls) or the bare cause
(Serve's gRPC transport)."""

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from vllm.exceptions import VLLMValidationError

from cluster.ingress import _replica_gone, raised_by_replica
from replicas.openai_api import exception_reply


def wrapped(cause: Exception) -> RayTaskError:
    return RayTaskError("call", "Traceback (most recent call last):\n  ...", cause, "proc", 1, "127.0.0.1").as_instanceof_cause()


def test_a_validation_error_raised_in_a_replica_is_a_400_with_vllms_message_in_either_transport():
    cause = VLLMValidationError("`logprobs` must be a positive value or -1.", parameter="logprobs", value=-1e308)
    for delivered in (wrapped(cause), cause):
        raised = raised_by_replica(delivered)
        assert raised is cause
        reply = exception_reply(raised)
        assert reply.status == 400
        err = reply.body["error"]
        assert err["code"] == 400 and err["type"] == "BadRequestError" and err["param"] == "logprobs"
        assert "must be a positive value" in err["message"] and "Traceback" not in err["message"]


def test_builtin_input_errors_are_400_and_other_exceptions_500():
    assert exception_reply(raised_by_replica(wrapped(ValueError("bad n")))).status == 400
    assert exception_reply(raised_by_replica(TypeError("not a list"))).status == 400
    server = exception_reply(raised_by_replica(wrapped(RuntimeError("engine bug"))))
    assert server.status == 500 and server.body["error"]["type"] == "InternalServerError"


def test_failures_of_ray_or_serve_are_not_the_replicas_answer():
    for failure in (ActorDiedError(), ActorUnavailableError("gone", None), BackPressureError(num_queued_requests=3, max_queued_requests=2),
                    DeploymentUnavailableError("EngineReplica")):
        assert raised_by_replica(failure) is None
    assert _replica_gone(ActorDiedError()) and not _replica_gone(VLLMValidationError("x"))
