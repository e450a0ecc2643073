"""Every error a client of the inference API can see, in OpenAI's shape, made in this one place.

``{"error": {"message", "type", "param", "code"}}``: the gateway and the pool raise ``ApiError`` and
render it with ``body()``; errors that come back from a vLLM replica are reshaped by
``from_replica`` so clients never see two dialects.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
SERVER = "server_error"
UNAVAILABLE = "service_unavailable_error"


@dataclass
class ApiError(Exception):
    status: int
    message: str
    type: str = INVALID_REQUEST
    param: str | None = None
    code: str | None = None

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def json_bytes(self) -> bytes:
        return json.dumps(self.body()).encode()

    def __str__(self) -> str:
        return f"{self.status} {self.code or self.type}: {self.message}"


def missing_api_key() -> ApiError:
    return ApiError(
        401,
        "You didn't provide an API key. Use the header 'Authorization: Bearer <your API key>'.",
        AUTHENTICATION,
        code="missing_api_key",
    )


def invalid_api_key() -> ApiError:
    return ApiError(
        401, "Incorrect API key provided, or the key has been revoked.", AUTHENTICATION, code="invalid_api_key"
    )


def invalid_body(detail: str) -> ApiError:
    return ApiError(400, f"The request body is not usable: {detail}", INVALID_REQUEST, code="invalid_request_body")


def model_not_found(name: str) -> ApiError:
    # The same answer whether the model does not exist or belongs to someone else.
    return ApiError(
        404,
        f"The model `{name}` does not exist or you do not have access to it.",
        INVALID_REQUEST,
        param="model",
        code="model_not_found",
    )


def adapter_not_found(name: str) -> ApiError:
    return ApiError(
        404,
        f"The fine-tuned model `{name}` has no adapter in the dynamic LoRA path (it was deleted, or is not "
        "published yet).",
        INVALID_REQUEST,
        param="model",
        code="adapter_not_found",
    )


def adapter_rank_too_large(name: str, rank: int, max_rank: int) -> ApiError:
    return ApiError(
        400,
        f"The fine-tuned model `{name}` has LoRA rank {rank}, more than this deployment serves "
        f"(max_lora_rank {max_rank}). Retrain it with a rank of at most {max_rank}.",
        INVALID_REQUEST,
        param="model",
        code="adapter_rank_too_large",
    )


def adapter_invalid(name: str, detail: str) -> ApiError:
    return ApiError(
        500,
        f"The adapter of `{name}` cannot be loaded: {detail}. Republish it; other models are not affected.",
        SERVER,
        param="model",
        code="adapter_invalid",
    )


def no_replica(model_id: str) -> ApiError:
    return ApiError(
        503,
        f"No replica of `{model_id}` is ready: they are starting or restarting (a CPU engine needs about a "
        "minute). Retry shortly.",
        UNAVAILABLE,
        code="no_replica_available",
    )


def pool_unreachable(detail: str) -> ApiError:
    return ApiError(
        503, f"The inference pool cannot be reached ({detail}). Retry shortly.", UNAVAILABLE, code="pool_unavailable"
    )


def replica_failed(detail: str) -> ApiError:
    return ApiError(502, f"The model replica failed while answering: {detail}", SERVER, code="replica_error")


_CONTEXT_LENGTH = re.compile(r"maximum context length|max_model_len|exceeds this limit", re.IGNORECASE)
_TYPE_FOR_STATUS = {400: INVALID_REQUEST, 404: INVALID_REQUEST, 422: INVALID_REQUEST}


def from_replica(status: int, raw: bytes) -> ApiError:
    """Reshape a vLLM error (``type`` like ``BadRequestError``, ``code`` the HTTP status) into ours."""
    try:
        error = json.loads(raw)["error"]
        message = str(error.get("message") or raw[:500].decode(errors="replace"))
        param = error.get("param") if isinstance(error.get("param"), str) else None
    except (ValueError, KeyError, TypeError, AttributeError):
        message, param = raw[:500].decode(errors="replace") or f"HTTP {status}", None
    if status == 400 and _CONTEXT_LENGTH.search(message):
        return ApiError(400, message, INVALID_REQUEST, param=param or "messages", code="context_length_exceeded")
    if status < 500:
        return ApiError(status, message, _TYPE_FOR_STATUS.get(status, INVALID_REQUEST), param=param)
    return replica_failed(message)
