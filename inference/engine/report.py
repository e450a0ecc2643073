"""A replica tells the pool which LoRA kernels it runs: ``GET REPORT_PATH`` (``inference.engine_contract``).

``inference.engine.server`` adds this to vLLM's server as a middleware (vLLM's supported way to add
to its app; its import path is the contract's ``REPORT_MIDDLEWARE``), inside ``ReplicaGuard``, so it
needs the internal token like every other route. The pool reads it when a replica becomes ready, for
its /health and /metrics (``inference.replica``).
"""

from __future__ import annotations

from dataclasses import asdict

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from inference.engine.state import state
from inference.engine_contract import REPORT_PATH


class LoraKernelsReport:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == REPORT_PATH and scope["method"] == "GET":
            await JSONResponse(asdict(state()))(scope, receive, send)
            return
        await self.app(scope, receive, send)
