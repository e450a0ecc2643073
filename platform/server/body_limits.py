"""The size of a request body, capped before anything reads it: the outermost ASGI layer.

A body is refused before the API key is looked up, before Django spools it to a temporary file
and before the gateway parses it, so an anonymous caller cannot make the web process read, store
or parse more than the cap. The cap depends on the path (``RequestLimits``): completions, uploads
(a dataset, ``MAX_UPLOAD_MB``, or an adapter, ``MAX_ADAPTER_UPLOAD_MB``, plus room for the multipart
form around it; ``finetuning.files`` and ``finetuning.adapters`` then check the file itself), and
everything else. A declared ``Content-Length`` over the cap is
a 413 at once; a body without one (chunked) is counted as it arrives, and refused as soon as it
passes the cap.

The refusal is JSON in the API's shape, except for a person: a dashboard form sent by a browser
(a path outside the API, asking for HTML) gets a small page with the same status, a sentence for
people (the one the form shows beside its file field: ``base.upload_limits``) and a link back to
the form, not a screen of raw JSON.
"""

from __future__ import annotations

from starlette.responses import HTMLResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from core.api_errors import ApiError, send_asgi
from core.config import ADAPTER_UPLOAD_LIMIT_SETTING, UPLOAD_LIMIT_SETTING, Limit

# The multipart envelope around an uploaded file: boundaries, part headers, the purpose field, the
# dashboard's CSRF token. A few hundred bytes in practice; generous, as the file's own size is
# checked exactly afterwards.
MULTIPART_ALLOWANCE_BYTES = 64 * 1024
# The first segments of the API's paths: their refusals stay JSON, whatever the client accepts.
API_ROOTS = ("v1", "api")


# A declared length this long is not a length (and is over any cap): refused without repeating it.
_PAST_ANY_CAP = 10**18


class _TooLarge(Exception):
    """Raised from ``receive`` into the application, which never sees the rest of the body."""


def body_too_large(path: str, limit: Limit, size: int | None) -> ApiError:
    """``size`` is None for a body of unknown length (chunked), refused once it passed the limit."""
    told = "is larger than" if size is None else f"is {size:,} bytes; more than"
    return ApiError(
        f"The request body {told} the {limit.value:,} bytes allowed for {path} ({limit.setting}).",
        status=413, code="request_too_large",
    )


def with_body_limits(application: ASGIApp) -> ASGIApp:
    """Call once Django is set up: the paths come from its URL configuration."""
    from django.conf import settings
    from django.urls import reverse
    from base.error_responses import too_large_page
    from base.upload_limits import adapter_too_large_message, file_too_large_message
    from gateway.asgi import ENDPOINTS

    kinds = (
        dict.fromkeys(ENDPOINTS, "completion")
        | dict.fromkeys((reverse("file-list"), reverse("dashboard:datasets")), "upload")
        | dict.fromkeys((reverse("fine-tuning-adapter-upload"), reverse("dashboard:adapter_upload")), "adapter upload")
    )
    # A dashboard form refused for its file's size: the form's own sentence, and a link back to it.
    form_pages = {
        reverse("dashboard:datasets"): file_too_large_message,
        reverse("dashboard:adapter_upload"): adapter_too_large_message,
    }

    def limit_for(path: str) -> Limit:
        # Read per request, as every setting, so a changed setting (a test's) applies at once.
        config = settings.CONFIG
        kind = kinds.get(path)
        if kind == "completion":
            return config.request_limits.completion_body_bytes
        if kind == "upload":
            return Limit(config.max_upload_bytes + MULTIPART_ALLOWANCE_BYTES, UPLOAD_LIMIT_SETTING)
        if kind == "adapter upload":
            return Limit(config.max_adapter_upload_bytes + MULTIPART_ALLOWANCE_BYTES, ADAPTER_UPLOAD_LIMIT_SETTING)
        return config.request_limits.request_body_bytes

    async def refuse(scope: Scope, receive: Receive, send: Send, limit: Limit, size: int | None) -> None:
        path = scope["path"]
        error = body_too_large(path, limit, size)
        if not _wants_a_page(scope):
            await send_asgi(error, send, close_connection=True)
            return
        if path in form_pages:  # a dashboard upload form: back to it
            message, back = form_pages[path](), path
        else:  # any path at all (never put in a link): back to the start
            message, back = error.message, reverse("dashboard:home")
        page = HTMLResponse(too_large_page(message, back), status_code=error.status, headers={"connection": "close"})
        await page(scope, receive, send)  # a plain response: it reads nothing

    async def limited(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await application(scope, receive, send)
            return
        limit = limit_for(scope["path"])
        declared = _content_length(scope)
        if declared is not None and declared > limit.value:
            await refuse(scope, receive, send, limit, declared if declared < _PAST_ANY_CAP else None)
            return
        received, started, refused = 0, False, False

        async def counting_receive() -> Message:
            nonlocal received, refused
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit.value:
                    refused = True
                    raise _TooLarge
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if refused:  # whatever the application answers to _TooLarge (a 500, say), ours is the answer
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await application(scope, counting_receive, guarded_send)
        except Exception:
            if not refused:  # _TooLarge, or whatever the application made of it
                raise
        if refused and not started:
            await refuse(scope, receive, send, limit, None)

    return limited


def _wants_a_page(scope: Scope) -> bool:
    """A browser sending a dashboard form; not the API, nor the dashboard's own scripts (the
    playground's chat is fetched as JSON and reads the API's error shape)."""
    if scope["path"].split("/")[1] in API_ROOTS:
        return False
    accept = next((value for name, value in scope["headers"] if name == b"accept"), b"")
    return b"text/html" in accept


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            if not value.isdigit():
                return None  # the server refuses a malformed one
            # Compared by length first: 5,000 digits would make int() raise (and are over any cap).
            return int(value) if len(value) < len(str(_PAST_ANY_CAP)) else _PAST_ANY_CAP
    return None
