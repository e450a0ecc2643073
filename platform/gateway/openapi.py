"""The inference endpoints in the OpenAPI schema (``/api/schema``), beside the REST API's.

They are plain Django views (and an ASGI fast path), not DRF views, so drf-spectacular cannot see
them: this post-processing hook writes their operations. Request bodies list the fields the
gateway accepts (``core.openai_protocol.REQUEST_FIELDS``: one source, so the schema and the check
cannot drift) with the types of the ones it checks itself; vLLM validates the rest. The model
lists are pydantic models, rendered from their own JSON schema.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from core.openai_protocol import REQUEST_FIELDS, AdapterShare, ModelCard, ModelList
from core.responses_protocol import ResponsesRequest
from core.tool_calls import FUNCTION_NAME

if TYPE_CHECKING:
    from drf_spectacular.generators import SchemaGenerator
    from rest_framework.request import Request

ERROR = {"$ref": "#/components/schemas/InferenceError"}
BEARER: list[dict[str, list[str]]] = [{"InferenceKey": []}]
# The fields the gateway checks (types and caps, tools: ``core.request_limits``), and the messages' shape.
_COUNT = {"type": "integer", "minimum": 0}
_TYPED_FIELDS: dict[str, dict] = {
    "model": {"type": "string", "description": "A base model, or a fine-tuned one: <base_model_id>:<suffix>"},
    "stream": {"type": "boolean"},
    "n": _COUNT, "max_tokens": _COUNT, "max_completion_tokens": _COUNT, "min_tokens": _COUNT,
    "top_logprobs": _COUNT, "prompt_logprobs": _COUNT,
    "temperature": {"type": "number", "minimum": 0}, "top_p": {"type": "number", "minimum": 0, "maximum": 1},
    "messages": {
        "type": "array", "minItems": 1,
        "items": {
            "type": "object", "required": ["role", "content"],
            "properties": {"role": {"type": "string", "enum": ["system", "user", "assistant"]}, "content": {"type": "string"}},
        },
    },
    "prompt": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
    "tools": {"type": "array", "items": {
        "type": "object", "required": ["type", "function"],
        "properties": {"type": {"enum": ["function"]}, "function": {
            "type": "object", "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": FUNCTION_NAME.pattern}, "description": {"type": "string"},
                "parameters": {"type": "object", "description": "A JSON Schema of the arguments object"},
                "strict": {"type": "boolean"},
            },
        }},
    }},
    "tool_choice": {"oneOf": [
        {"enum": ["auto", "none", "required"]},
        {"type": "object", "required": ["type", "function"], "properties": {
            "type": {"enum": ["function"]},
            "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}},
        }},
    ]},
    "parallel_tool_calls": {"type": "boolean"},
    "adapters": {
        "type": "array", "items": AdapterShare.model_json_schema(),
        "description": (
            "A mix: fine-tunes of the base model 'model' names (then 'model' must be that base model), each "
            "with a scale; served as the sum of their scaled LoRA deltas. All scales 0 is the base model. "
            "At most MAX_MIX_ADAPTERS entries, and at most the replica's batch slots (max_loras)."
        ),
    },
}
_ERRORS = {
    "400": "The body is not valid, a field is unknown or over its cap",
    "401": "No API key, or not a valid one",
    "404": "No such model for this organization",
    "429": "Over a rate limit (Retry-After says when to try again)",
    "503": "No replica is ready, or the pool is unreachable (Retry-After)",
}


def _request_body(endpoint: str) -> dict:
    required = ["model", "messages" if endpoint == "chat/completions" else "prompt"]
    properties = {name: _TYPED_FIELDS.get(name, {}) for name in sorted(REQUEST_FIELDS[endpoint] | {"model"})}
    schema = {"type": "object", "required": required, "properties": properties, "additionalProperties": False}
    return {"required": True, "content": {"application/json": {"schema": schema}}}


def _responses_request_body() -> tuple[dict, dict[str, dict]]:
    """POST /v1/responses' body, from the model that checks it (one source), and its parts as components."""
    schema = ResponsesRequest.model_json_schema(ref_template="#/components/schemas/Responses{model}")
    parts = {f"Responses{name}": part for name, part in schema.pop("$defs").items()}
    schema["properties"]["input"] = {"anyOf": [{"type": "string"}, schema["properties"]["input"]]}  # a string is one user message
    return {"required": True, "content": {"application/json": {"schema": schema}}}, parts


def _responses(ok: dict, *errors: str) -> dict:
    answers = {"200": {"description": "OK", "content": {"application/json": {"schema": ok}}}}
    for status in errors:
        answers[status] = {"description": _ERRORS[status], "content": {"application/json": {"schema": ERROR}}}
    return answers


def _operation(operation_id: str, summary: str, responses: dict, **more: Any) -> dict:
    return {"operationId": operation_id, "summary": summary, "tags": ["inference"], "security": BEARER, "responses": responses, **more}


def add_inference_endpoints(result: dict, generator: SchemaGenerator, request: Request | None, public: bool) -> dict:
    """drf-spectacular's POSTPROCESSING_HOOKS signature."""
    completion = {"type": "object", "description": "OpenAI's completion object, or with stream=true a text/event-stream"}
    card, listing = {"$ref": "#/components/schemas/ModelCard"}, {"$ref": "#/components/schemas/ModelList"}
    model_path = [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]
    response_path = [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    responses_body, responses_parts = _responses_request_body()
    response = {"type": "object", "description": "OpenAI's Response object, or with stream=true a text/event-stream of its events"}
    result["paths"].update({
        "/v1/chat/completions": {"post": _operation(
            "chat_completions_create", "Chat with a base or fine-tuned model", _responses(completion, "400", "401", "404", "429", "503"),
            requestBody=_request_body("chat/completions"),
        )},
        "/v1/completions": {"post": _operation(
            "completions_create", "Complete a prompt", _responses(completion, "400", "401", "404", "429", "503"),
            requestBody=_request_body("completions"),
        )},
        "/v1/responses": {"post": _operation(
            "responses_create", "OpenAI's Responses API, answered through chat completions",
            _responses(response, "400", "401", "404", "429", "503"), requestBody=responses_body,
        )},
        "/v1/responses/{response_id}": {
            method: _operation(
                f"responses_{name}", "Responses are not stored: always a 404 that says so",
                {**_responses({"type": "object"}, "401", "404")}, parameters=response_path,
            )
            for method, name in (("get", "retrieve"), ("delete", "delete"))
        },
        "/v1/models": {"get": _operation("models_list", "The models this key's organization may use", _responses(listing, "401"))},
        "/v1/models/{model}": {
            "get": _operation("models_retrieve", "One model", _responses(card, "401", "404"), parameters=model_path),
            "delete": _operation(
                "models_delete", "Delete a fine-tuned model of the organization (owners, or members when allowed)",
                _responses({"type": "object"}, "401", "404"), parameters=model_path,
            ),
        },
    })
    listing_schema = ModelList.model_json_schema(ref_template="#/components/schemas/{model}")
    listing_schema.pop("$defs")  # ModelCard is a component of its own
    components = result.setdefault("components", {})
    components.setdefault("schemas", {}).update({
        **responses_parts,
        "ModelCard": ModelCard.model_json_schema(),
        "ModelList": listing_schema,
        "InferenceError": {
            "type": "object", "required": ["error"],
            "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"]}},
        },
    })
    components.setdefault("securitySchemes", {})["InferenceKey"] = {"type": "http", "scheme": "bearer"}
    return result
