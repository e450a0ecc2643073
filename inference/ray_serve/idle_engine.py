"""A Ray Serve replica's engine, asleep while idle: a model scaled to zero with ``idle = "sleep"``
keeps one replica (``app.replica_options``), whose engine sleeps after ``downscale_delay_s`` without
a request (its KV cache given back, the process kept, as on the pool: ``inference.engine.sleep``)
and wakes for the next, in about a tenth of a second instead of a replica's start.

Serve's health check, every few seconds, is when the replica looks whether it has been idle long
enough. A request counts from its first moment (before its adapters load), so none finds the
engine falling asleep under it; one that comes while it falls asleep waits for that, then wakes it.
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx

from core.catalog import BaseModel
from inference.replica import sleep_engine, wake_engine

log = logging.getLogger("inference.ray_serve.idle_engine")


class IdleEngine:
    def __init__(self, model: BaseModel, admin: httpx.AsyncClient, url: str) -> None:
        scaling = model.autoscaling
        self.sleeps_when_idle = scaling.keeps_one_asleep
        self.idle_after_s = scaling.downscale_delay_s
        self.admin, self.url = admin, url
        self.asleep = False
        self.answering = 0  # requests under way
        self.last_active_at = float("-inf")  # idle since it started: it falls asleep at the first look
        self._changing = asyncio.Lock()  # one sleep or wake at a time; requests wait for a wake under way

    def begin(self) -> None:
        """A request starts (then ``await awake()``); ``end()`` when it is over, however it ends."""
        self.answering += 1
        self.last_active_at = time.monotonic()

    def end(self) -> None:
        self.answering -= 1
        self.last_active_at = time.monotonic()

    async def awake(self) -> None:
        """The engine awake for a request: woken if it sleeps."""
        if not self.asleep:
            return
        async with self._changing:
            if self.asleep:
                await wake_engine(self.admin, self.url)
                self.asleep = False
                log.info("the vLLM server at %s is awake", self.url)

    async def sleep_if_idle(self) -> None:
        idle_s = time.monotonic() - self.last_active_at
        if not self.sleeps_when_idle or self.asleep or self.answering or idle_s < self.idle_after_s:
            return
        async with self._changing:
            if self.answering:
                return  # a request came while a wake held the lock
            self.asleep = True  # first: a request that comes now waits for the lock, then wakes the engine
            await sleep_engine(self.admin, self.url)
            log.info("the vLLM server at %s is asleep", self.url)
