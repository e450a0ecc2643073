"""Each organization's own prefix cache in vLLM.

vLLM reuses the KV cache of a prompt prefix it has seen, and answers faster when it does: without
a salt, one tenant could time requests to learn what another's prompts begin with. Blocks cached
under different ``cache_salt`` values are never shared, so every request carries its
organization's salt, and a salt the caller sent is replaced (a guessed one would open another
organization's cache). The salt is an HMAC of the organization's id with SECRET_KEY: the same in
every web process, and not derivable by a caller. ``answering.forwarded_body`` puts it in.
"""

from __future__ import annotations

import hashlib
import hmac

from django.conf import settings


def cache_salt(organization_id: int) -> str:
    # 64 hex characters: within vLLM's 128, and none of the '@', '/', '\\' it refuses.
    message = f"vllm-cache-salt:{organization_id}".encode()
    return hmac.new(settings.SECRET_KEY.encode(), message, hashlib.sha256).hexdigest()

