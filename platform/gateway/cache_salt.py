"""Each organization's own prefix cache in vLLM.

vLLM reuses the KV cache of a prompt prefix it has seen, and answers faster when it does: without
a salt, one tenant could time requests to learn what another's prompts begin with. Blocks cached
under different ``cache_salt`` values are never shared, so every request carries its
organization's salt, and a salt the caller sent is replaced (a guessed one would open another
organization's cache). The salt is an HMAC of the organization's id with SECRET_KEY: the same in
every web process, and not derivable by a caller.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

from django.conf import settings


def cache_salt(organization_id: int) -> str:
    # 64 hex characters: within vLLM's 128, and none of the '@', '/', '\\' it refuses.
    message = f"vllm-cache-salt:{organization_id}".encode()
    return hmac.new(settings.SECRET_KEY.encode(), message, hashlib.sha256).hexdigest()


def with_cache_salt(body: bytes, data: dict[str, Any], salt: str) -> bytes:
    """``body`` (whose parsed form is ``data``) with ``salt`` as its ``cache_salt``.

    The common case costs a copy: the field goes in front of the caller's own bytes, which need no
    re-serializing. When the caller sent a ``cache_salt`` (a later duplicate would win over ours),
    or the body does not start with ``{``, the parsed body is serialized again with ours in place.
    """
    start = len(body) - len(body.lstrip(b" \t\r\n"))
    if "cache_salt" not in data and body[start : start + 1] == b"{":
        return b'%s{"cache_salt":"%s",%s' % (body[:start], salt.encode(), body[start + 1 :])
    return json.dumps(data | {"cache_salt": salt}).encode()
