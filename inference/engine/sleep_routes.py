"""A replica sleeps and wakes when the pool says: ``POST SLEEP_PATH`` and ``POST WAKE_PATH``
(``inference.engine_contract``), added to vLLM's server as a middleware like the kernels' report, so
inside ``ReplicaGuard`` (the internal token).

vLLM has these routes too, but only in its development mode, which also opens routes that run any
method of the engine; these two call the engine's own sleep and wake-up (``inference.engine.sleep``
makes them work on the CPU) and nothing else. Sleep waits for the requests under way to end; the
pool sends none while a replica sleeps, and any that came would wait for the wake.
"""

from __future__ import annotations

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from inference.engine_contract import SLEEP_PATH, WAKE_PATH


class SleepRoutes:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in (SLEEP_PATH, WAKE_PATH):
            await self.app(scope, receive, send)
            return
        engine = scope["app"].state.engine_client
        if scope["path"] == SLEEP_PATH:
            await engine.sleep(1, "wait")
        else:
            await engine.wake_up()
        await JSONResponse({"asleep": await engine.is_sleeping()})(scope, receive, send)
