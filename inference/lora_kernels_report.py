"""A replica tells the pool which LoRA kernels it runs: ``GET /fineserve/lora-kernels``.

``inference.vllm_server`` adds this to vLLM's server as a middleware (vLLM's supported way to add
to its app), inside ``ReplicaGuard``, so it needs the internal token like every other route. The
pool reads it when a replica becomes ready, for its /health and /metrics (``inference.replica``).
"""

from __future__ import annotations

from dataclasses import asdict

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from inference import lora_kernels

REPORT_PATH = "/fineserve/lora-kernels"
MIDDLEWARE = "inference.lora_kernels_report.LoraKernelsReport"  # the import path vLLM's --middleware takes


class LoraKernelsReport:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == REPORT_PATH and scope["method"] == "GET":
            await JSONResponse(asdict(lora_kernels.state()))(scope, receive, send)
            return
        await self.app(scope, receive, send)
