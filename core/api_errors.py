"""The one error a client of this platform sees, in OpenAI's shape, for every API and process, and
every named error, made in this one place.

``{"error": {"message", "type", "param", "code", ...}}``. Django-free, so the inference pool, the
gateway and the fine-tuning API raise the same class; ``base.error_responses`` (its Django
responses) translates DRF's own exceptions into it. Errors that come back from a vLLM replica are
reshaped by ``from_replica``, so clients never see two dialects.

A tenant never reads the platform's insides: addresses, file paths, an upstream's raw text. Where a
failure's detail is internal, the message says what happened and gives a request id, and the
detail goes to the log under the same id (``_logged``); where a replica's refusal is about the
tenant's own fields, its words stay, with addresses and paths taken out (``scrubbed``).
"""

from __future__ import annotations

import json
import logging
import re
import secrets
from typing import TYPE_CHECKING

from pydantic import ValidationError

from core.config import ADAPTER_UPLOAD_LIMIT_SETTING

if TYPE_CHECKING:
    from starlette.types import Send

log = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
SERVER = "server_error"
UNAVAILABLE = "service_unavailable_error"


class ApiError(Exception):
    """``extra`` adds fields to the error object (a dataset's per-line ``errors``); ``retry_after_s``
    says when a temporary outage is worth retrying (the ``Retry-After`` header, see ``headers``)."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
        **extra: object,
    ):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code, self.extra = (
            message,
            status,
            type,
            param,
            code,
            extra,
        )
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        return error_body(self.message, type=self.type, param=self.param, code=self.code, **self.extra)

    def headers(self) -> dict[str, str]:
        """The HTTP headers that go with the body."""
        return {} if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)}

    def json_bytes(self) -> bytes:
        return json.dumps(self.body()).encode()

    def __str__(self) -> str:
        return f"{self.status} {self.code or self.type}: {self.message}"


async def send_asgi(error: ApiError, send: Send, close_connection: bool = False) -> None:
    """Answer ``error`` on a raw ASGI connection, for the layers that stand in front of any
    framework (the body-size cap, the internal-token guard). ``close_connection``: the request's
    body was left unread, so the connection cannot carry another request."""
    body = error.json_bytes()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in error.headers().items()]
    if close_connection:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _logged(what: str, detail: str) -> str:
    """Log ``detail`` under a new request id, and return the id for the tenant's message."""
    request_id = f"req_{secrets.token_hex(12)}"
    log.warning("%s: %s: %s", request_id, what, detail)
    return request_id


def _see_log(request_id: str) -> str:
    return f"(request id {request_id}; quote it to the platform's operators)"


def logged_instead(what: str, detail: str) -> str:
    """For a page or an event that would show ``detail``: it goes to the log, and this, to show
    instead, names the request id it is logged under."""
    return _see_log(_logged(what, detail))


# What a message from inside may hold that a tenant must not read: URLs (with any scheme), absolute
# file paths of two segments or more, and network addresses. A model's name (``org/model:suffix``)
# is not absolute, so it stays.
_URL = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"`<>()\[\]]+")
_PATH = re.compile(r"(?<![\w.:/~-])/(?:[^\s/'\"`<>()\[\],;]+/)+[^\s/'\"`<>()\[\],;]*")
_ADDRESS = re.compile(r"\b(?:\d{1,3}\.){3}\d{1,3}(?::\d+)?\b|\blocalhost(?::\d+)?\b|\[[0-9a-fA-F:]+\](?::\d+)?")


def scrubbed(text: str) -> str:
    """``text`` without URLs, absolute paths or network addresses."""
    return _ADDRESS.sub("<address>", _PATH.sub("<path>", _URL.sub("<url>", text)))


def shown(value: str, most: int = 40) -> str:
    """A caller's value as a message repeats it: one of 5,000 characters is cut, not echoed whole."""
    return value if len(value) <= most else f"{value[:most]}... ({len(value):,} characters)"


def human_size(n: int) -> str:
    """A size as people read it in an error message."""
    return f"{n / 1024 / 1024:.1f} MB" if n >= 1024 * 1024 else f"{n} bytes"


def error_body(message: str, *, type: str, param: str | None = None, code: str | None = None, **extra: object) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code, **extra}}


def internal_error() -> ApiError:
    """What a client learns of a bug: that it happened, never its traceback or the settings (those
    go to the server's log)."""
    return ApiError(
        "The server had an error while processing your request; it has been logged.",
        status=500, type=SERVER, code="internal_error",
    )


def not_found(what: str, ident: str, param: str | None = None) -> ApiError:
    return ApiError(f"No such {what}: '{ident}'", status=404, param=param, code=f"{what.replace(' ', '_')}_not_found")


def missing_api_key() -> ApiError:
    return ApiError(
        "You didn't provide an API key. Use the header 'Authorization: Bearer <your API key>'.",
        status=401, type=AUTHENTICATION, code="missing_api_key",
    )


def invalid_api_key() -> ApiError:
    return ApiError(
        "Incorrect API key provided, or the key has been revoked.",
        status=401, type=AUTHENTICATION, code="invalid_api_key",
    )


def internal_token_required(setting: str, given: bool) -> ApiError:
    """For the platform's internal endpoints (the pool, the replicas, /metrics): an API key is not
    enough there. ``setting`` names the variable whose value opens them."""
    if given:
        return ApiError(
            f"The bearer token provided is not this platform's {setting}.",
            status=401, type=AUTHENTICATION, code="invalid_internal_token",
        )
    return ApiError(
        f"This endpoint is internal: send the header 'Authorization: Bearer <{setting}>'.",
        status=401, type=AUTHENTICATION, code="missing_internal_token",
    )


def object_body(data: object) -> dict:
    """A request's parsed body, when it is a JSON object; otherwise the 400 that says it must be."""
    if not isinstance(data, dict):
        raise ApiError("The request body must be a JSON object.", code="invalid_body")
    return data


def invalid_body(detail: str) -> ApiError:
    return ApiError(f"The request body is not usable: {detail}", code="invalid_request_body")


def unparsable_body(detail: str, param: str | None = None) -> ApiError:
    """A body that is not plain JSON (``core.strict_json``); ``param`` names the value at fault."""
    return ApiError(
        f"We could not parse the body of your request (JSON parse error): {detail}.", param=param, code="invalid_body"
    )


def invalid_fields(exc: ValidationError, hint: str = "") -> ApiError:
    """A body that failed a pydantic model: its first problem, with the field's dotted path."""
    problem = exc.errors()[0]
    where = ".".join(str(part) for part in problem.get("loc", ())) or "body"
    error = invalid_body(f"{where}: {problem['msg']}{hint}")
    error.param = None if where == "body" else where  # as OpenAI names the field at fault
    return error


def unknown_field(name: str, endpoint: str) -> ApiError:
    # OpenAI's words for it. vLLM itself would ignore the field, and the caller would never learn
    # that it did nothing (``guided_json``, gone from vLLM, is the usual one).
    return ApiError(
        f"Unrecognized request argument supplied: '{name}'. /v1/{endpoint} takes OpenAI's fields and "
        "vLLM's sampling extensions (see docs/limits.md); for constrained output use response_format "
        "or structured_outputs.",
        param=name, code="unknown_parameter",
    )


def over_limit(param: str, what: str, value: int | float, limit: int, setting: str, unit: str = "") -> ApiError:
    """``what`` names what was counted (``"'n'"``, ``"The number of messages"``), in ``unit``."""
    return ApiError(
        f"{what} is {value:,}{unit}; this platform allows at most {limit:,}{unit} ({setting}).",
        param=param, code="limit_exceeded",
    )


def not_a_number(param: str) -> ApiError:
    return ApiError(f"'{param}' must be a number.", param=param, code="invalid_type")


def model_not_found(name: str, param: str = "model") -> ApiError:
    # The same answer whether the model does not exist or belongs to someone else; ``param`` is
    # "adapters" for a model named in a mix.
    return ApiError(
        f"The model `{name}` does not exist or you do not have access to it.",
        status=404, param=param, code="model_not_found",
    )


def invalid_tools(param: str, problem: str) -> ApiError:
    return ApiError(f"{problem}.", param=param, code="invalid_value")


def tools_not_rendered(base_model_id: str) -> ApiError:
    return ApiError(
        f"The base model '{base_model_id}' has a chat template that renders no tools, so it cannot be offered "
        "'tools' (an operator adds a template that does: manage.py add_base_model --chat-template).",
        param="tools", code="tools_not_supported",
    )


def adapter_not_found(name: str, param: str = "model") -> ApiError:
    return ApiError(
        f"The fine-tuned model `{name}` has no adapter in the dynamic LoRA path (it was deleted, or is not "
        "published yet).",
        status=404, param=param, code="adapter_not_found",
    )


def mix_needs_base_model(model: str) -> ApiError:
    return ApiError(
        f"With 'adapters', 'model' names the base model they were fine-tuned from, not `{model}`: put "
        f"`{model}` in 'adapters' (with its scale) and its base model in 'model'.",
        param="model", code="mix_needs_base_model",
    )


def not_a_fine_tune_of(name: str, base_model_id: str, param: str = "adapters") -> ApiError:
    return ApiError(
        f"`{name}` in '{param}' is not a fine-tune of `{base_model_id}`; adapters are combined only with "
        "adapters of the same base model.",
        param=param, code="adapter_of_another_base_model",
    )


def mix_rank_too_large(ranks: dict[str, int], max_rank: int) -> ApiError:
    parts = ", ".join(f"`{name}` {rank}" for name, rank in ranks.items())
    return ApiError(
        f"These adapters mixed make one LoRA of rank {sum(ranks.values())} (the sum of their ranks: {parts}), "
        f"more than this deployment serves (max_lora_rank {max_rank}). Mix fewer adapters or ones of lower rank.",
        param="adapters", code="mix_rank_too_large",
    )


def mix_too_many_parts(parts: int, slots: int) -> ApiError:
    return ApiError(
        f"This mix names {parts} adapters, and each takes one of the {slots} adapter slots a batch has "
        f"on this deployment (max_loras). Mix at most {slots}.",
        param="adapters", code="mix_too_many_parts",
    )


def adapter_not_mixable(name: str, detail: str, param: str = "adapters") -> ApiError:
    return ApiError(
        f"The adapter of `{name}` cannot be combined with others: {detail}. It can still be used alone as 'model'.",
        param=param, code="adapter_not_mixable",
    )


def composition_rank_too_large(ranks: dict[str, int], max_rank: int) -> ApiError:
    parts = ", ".join(f"`{name}` {rank}" for name, rank in ranks.items())
    return ApiError(
        f"The exact combination of these models is one LoRA of rank {sum(ranks.values())} (the sum of their "
        f"ranks: {parts}), more than this deployment serves (max_lora_rank {max_rank}). Choose method 'svd', "
        f"'ties' or 'dare_linear' with a 'rank' of at most {max_rank} to approximate it, or fewer parents.",
        param="parents", code="composition_rank_too_large",
    )


def adapter_rank_too_large(name: str, rank: int, max_rank: int) -> ApiError:
    return ApiError(
        f"The fine-tuned model `{name}` has LoRA rank {rank}, more than this deployment serves "
        f"(max_lora_rank {max_rank}). Retrain it with a rank of at most {max_rank}.",
        param="model", code="adapter_rank_too_large",
    )


def adapter_invalid(name: str, detail: str) -> ApiError:
    """``detail`` says what is wrong with the adapter's files (the tenant's to fix), paths taken out."""
    return ApiError(
        f"The adapter of `{name}` cannot be loaded: {scrubbed(detail)}. Republish it; other models are not affected.",
        status=500, type=SERVER, param="model", code="adapter_invalid",
    )


class InvalidAdapter(ApiError):
    """An adapter the platform cannot serve (or train on); ``problem`` alone, for a caller that says
    which adapter it is in words of its own (a continued fine-tune's parent)."""

    def __init__(self, problem: str):
        super().__init__(f"The adapter cannot be accepted: {problem}.", param="file", code="invalid_adapter")
        self.problem = problem


def invalid_adapter(problem: str) -> InvalidAdapter:
    """An uploaded adapter the platform cannot serve; ``problem`` says what is wrong with it."""
    return InvalidAdapter(problem)


def adapter_too_large(limit_bytes: int) -> ApiError:
    return ApiError(
        f"The adapter cannot be accepted: its archive, or its files once unpacked, take more than "
        f"{limit_bytes // (1024 * 1024)} MB ({ADAPTER_UPLOAD_LIMIT_SETTING}).",
        param="file", code="adapter_too_large",
    )


def adapter_store_unreachable(name: str, detail: str) -> ApiError:
    request_id = _logged(f"the dynamic LoRA path of `{name}` does not answer", detail)
    return ApiError(
        f"The adapter of `{name}` cannot be read or written right now: its dynamic LoRA path does not answer "
        f"{_see_log(request_id)}. Nothing was changed; retry shortly.",
        status=503, type=UNAVAILABLE, param="model", code="adapter_store_unavailable", retry_after_s=5,
    )


def suffix_taken(name: str) -> ApiError:
    return ApiError(
        f"The suffix is taken: '{name}' already exists or is being trained. To publish a new revision of "
        f"your own model, fine-tune it further: set model to '{name}' and keep the suffix.",
        status=409, param="suffix", code="suffix_taken",
    )


def request_over_token_rate(tokens: int, limit: int, setting: str) -> ApiError:
    """Waiting would not help: the request alone is over the minute's tokens (``gateway.limits``)."""
    return ApiError(
        f"This request may use about {tokens:,} tokens (its prompt and the most it may generate), more than the "
        f"{limit:,} tokens per minute allowed ({setting}). Set max_tokens lower, or send a shorter prompt.",
        param="max_tokens", code="request_too_large",
    )


def adapter_slots_busy(model_id: str, kind: str, limit: int) -> ApiError:
    """An organization at its fair use of a replica (``inference.adapter_slots.FairUse``) with every
    adapter of its own answering: none can make room, and another organization's never does.
    ``kind``: "mixes" (its cap of distinct mixes), "share" (of the replica's adapters), "batch" (of
    the adapters one batch holds)."""
    held, setting = {
        "mixes": (f"holds {limit} different mixes", "max_mixes_per_organization"),
        "share": (f"holds {limit} adapters, its share while other organizations use it too", "organization_share"),
        "batch": (
            (
                f"has {limit} different adapters answering at once, its share of a batch while other "
                "organizations use it too"
            ),
            "organization_share",
        ),
    }[kind]
    return ApiError(
        f"Your organization {held}, on the replica of `{model_id}` this request went to (the model catalog's "
        f"lora_config {setting}), and each of them is answering a request, so none can make room for another. "
        "Retry when some have finished, or send fewer different adapters or mixes (scales) at once.",
        status=429, type="requests", param="adapters" if kind == "mixes" else "model", code="adapter_slots_busy",
        retry_after_s=1,
    )


def no_replica(model_id: str) -> ApiError:
    return ApiError(
        f"No replica of `{model_id}` is ready: they are starting or restarting (a CPU engine needs about a "
        "minute). Retry shortly.",
        status=503, type=UNAVAILABLE, code="no_replica_available", retry_after_s=5,
    )


def model_does_not_fit(model_id: str, why: str) -> ApiError:
    return ApiError(
        f"`{model_id}` cannot start here: {why}.", status=503, type=UNAVAILABLE, code="model_does_not_fit",
        retry_after_s=60,
    )


def model_starting(model_id: str, retry_after_s: int) -> ApiError:
    return ApiError(
        f"`{model_id}` was scaled to zero and is starting for this request (a CPU engine needs about a minute). "
        f"Retry in {retry_after_s} seconds.",
        status=503, type=UNAVAILABLE, code="model_starting", retry_after_s=retry_after_s,
    )


def model_cold(model_id: str) -> ApiError:
    """Not a fault: a model scaled to zero starts on its next completion, not for a preload."""
    return ApiError(
        f"`{model_id}` is scaled to zero: no replica runs until a completion asks for it.",
        status=409, code="model_cold",
    )


def pool_unreachable(detail: str) -> ApiError:
    request_id = _logged("the inference pool cannot be reached", detail)
    return ApiError(
        f"The inference pool cannot be reached {_see_log(request_id)}. Retry shortly.",
        status=503, type=UNAVAILABLE, code="pool_unavailable", retry_after_s=2,
    )


def mix_not_supported(model_id: str, reason: str) -> ApiError:
    # A Ray replica mixes in its LoRA kernel only; one whose kernels fell back cannot.
    return ApiError(
        f"This replica of `{model_id}` cannot mix adapters per request ({reason or 'its LoRA kernels are off'}): "
        "name one fine-tuned model in `model`, or compose the mix into a model of its own "
        "(POST /v1/fine_tuning/models).",
        status=503, type=UNAVAILABLE, param="adapters", code="mix_not_supported",
    )


def replica_lost(detail: str) -> ApiError:
    # Not retried on another replica: the request may have reached this one, and a generation must
    # never run twice. The client decides (the official clients retry a 503 after Retry-After).
    request_id = _logged("a model replica stopped answering after it received a request", detail)
    return ApiError(
        f"The model replica stopped answering after it received your request {_see_log(request_id)}. It was not "
        "sent again, so it cannot have run twice. Retry.",
        status=503, type=UNAVAILABLE, code="replica_unavailable", retry_after_s=1,
    )


def adapter_store_unavailable(name: str, detail: str) -> ApiError:
    request_id = _logged(f"the dynamic LoRA path of `{name}` cannot be read", detail)
    return ApiError(
        f"The adapter of `{name}` is not on this replica yet and its dynamic LoRA path cannot be read "
        f"right now {_see_log(request_id)}. Retry shortly; models already loaded keep answering.",
        status=503, type=UNAVAILABLE, param="model", code="adapter_store_unavailable", retry_after_s=5,
    )


def pool_timeout(detail: str) -> ApiError:
    request_id = _logged("the inference pool did not answer in time", detail)
    return ApiError(
        f"The inference pool did not answer in time {_see_log(request_id)}.", status=504, type=SERVER, code="timeout"
    )


def replica_failed(detail: str) -> ApiError:
    request_id = _logged("a model replica failed while answering", detail)
    return ApiError(
        f"The model replica failed while answering {_see_log(request_id)}.",
        status=502,
        type=SERVER,
        code="replica_error",
    )


def method_not_allowed(method: str) -> ApiError:
    return ApiError(f"Use {method} for this endpoint.", status=405, code="method_not_allowed")


_CONTEXT_LENGTH = re.compile(r"maximum context length|max_model_len|exceeds this limit", re.IGNORECASE)


def made_by_vllm(raw: bytes) -> bool:
    """Whether an error body is vLLM's (its ``code`` the HTTP status), not one of ours (a string
    ``code``) relayed by a layer in between, which is already fit for the tenant."""
    try:
        return not isinstance(json.loads(raw)["error"]["code"], str)
    except (ValueError, KeyError, TypeError):
        return True


def from_replica(status: int, raw: bytes) -> ApiError:
    """Reshape a vLLM error (``type`` like ``BadRequestError``, ``code`` the HTTP status) into ours.
    A refusal (4xx) is about the request: its words stay, scrubbed. A failure (5xx) is vLLM's own,
    and its text (a traceback's last line, a path) goes to the log only."""
    try:
        error = json.loads(raw)["error"]
        message = str(error.get("message") or raw[:500].decode(errors="replace"))
        param = error.get("param") if isinstance(error.get("param"), str) else None
    except (ValueError, KeyError, TypeError, AttributeError):
        message, param = raw[:500].decode(errors="replace") or f"HTTP {status}", None
    if status == 401:  # the replica refused the pool's token: nothing the caller can fix
        return replica_failed(f"the replica refused the pool's INTERNAL_TOKEN ({message})")
    if status >= 500:
        return replica_failed(message)
    message = scrubbed(message)
    if status == 400 and _CONTEXT_LENGTH.search(message):
        return ApiError(message, param=param or "messages", code="context_length_exceeded")
    return ApiError(message, status=status, param=param)
