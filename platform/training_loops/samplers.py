"""Sampling sessions: what a sampler samples from (a base model, or saved sampler weights by their
served name), for one organization. A session is a handle in Redis, kept SAMPLER_TTL_S after its
last use; the weights it names stay where they were saved. The web opens one for
``create_sampling_session``, the trainer for an unnamed ``save_weights_for_sampler``.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import asdict, dataclass

import redis

from core import api_errors
from training_loops.futures import async_redis

SAMPLER_TTL_S = 24 * 3600


@dataclass(frozen=True)
class Sampler:
    organization_id: int
    model: str  # a base model id, or a sampler save's served name (``<base>:tinker-<run>@r<k>``)
    base_model: str


def _key(sampler_id: str) -> str:
    return f"loops:sampler:{sampler_id}"


def _new_id() -> str:
    return "sampler_" + secrets.token_hex(12)


def open_sampler(client: redis.Redis, sampler: Sampler) -> str:
    sampler_id = _new_id()
    client.set(_key(sampler_id), json.dumps(asdict(sampler)), ex=SAMPLER_TTL_S)
    return sampler_id


async def open_sampler_async(sampler: Sampler) -> str:
    sampler_id = _new_id()
    client = async_redis()
    try:
        await client.set(_key(sampler_id), json.dumps(asdict(sampler)), ex=SAMPLER_TTL_S)
    finally:
        await client.aclose()
    return sampler_id


async def sampler_of(organization_id: int, sampler_id: str) -> Sampler:
    """The organization's sampling session (its lease renewed); another's, or an expired one, is a 404."""
    client = async_redis()
    try:
        found = await client.getex(_key(sampler_id[:100]), ex=SAMPLER_TTL_S)
    finally:
        await client.aclose()
    sampler = Sampler(**json.loads(found)) if found is not None else None
    if sampler is None or sampler.organization_id != organization_id:
        raise api_errors.not_found("sampling session", sampler_id[:100], "sampling_session_id")
    return sampler
