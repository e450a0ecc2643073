"""Only the platform's own processes may call the pool and its vLLM replicas.

Anyone who can open a local port could otherwise run completions with any tenant's adapter, read
every organization's model names in the metrics, or (on a replica) load an adapter from any path
and unload another tenant's. ``RequireInternalToken`` wraps the pool's application and every
managed replica's (``ReplicaGuard``): a request without ``Authorization: Bearer <internal token>``
gets a 401 in OpenAI's shape before it reaches any route, health checks included (the web's health
check sends the token like every other caller).
"""

from __future__ import annotations

import os

from starlette.types import ASGIApp, Receive, Scope, Send

from core import api_errors
from core.api_errors import send_asgi
from core.internal_token import presents

# The variable vLLM itself reads for --api-key: the pool passes the token to a replica this way,
# in its environment (readable by its own user only), not on its command line (readable by anyone
# on the machine through ps or /proc).
REPLICA_TOKEN_VARIABLE = "VLLM_API_KEY"


class RequireInternalToken:
    """Pure ASGI, so a completion pays one header scan and one comparison, not a middleware stack."""

    def __init__(self, app: ASGIApp, token: str, setting: str = "INTERNAL_TOKEN"):
        if not token:
            raise ValueError("no internal token: refusing to serve without one")  # fail closed
        self.app, self.token, self.setting = app, token, setting

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):  # lifespan: start-up and shut-down
            await self.app(scope, receive, send)
            return
        authorization = next((value for name, value in scope["headers"] if name == b"authorization"), None)
        if presents(authorization, self.token):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await send_asgi(api_errors.internal_token_required(self.setting, given=authorization is not None), send)


class ReplicaGuard(RequireInternalToken):
    """For a vLLM server, which adds it with ``--middleware inference.internal_auth.ReplicaGuard``.

    vLLM's own ``--api-key`` guards only paths under /v1, /v2, /inference and /cohere; the same
    server answers /invocations (completions with any loaded adapter), /adapters (SageMaker's LoRA
    load and unload, from any path) and /metrics (every adapter's name) to anyone. This guards all.
    vLLM constructs middleware without arguments, so the token comes from vLLM's own variable."""

    def __init__(self, app: ASGIApp):
        super().__init__(app, os.environ.get(REPLICA_TOKEN_VARIABLE, ""), setting=REPLICA_TOKEN_VARIABLE)
