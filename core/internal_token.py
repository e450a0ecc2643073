"""The credential the platform's own processes present to each other: web -> pool -> vLLM replicas.

Those processes are started separately (by honcho, or on other machines), so a random token made
at start-up could not be shared; each derives the same one from SECRET_KEY, which they already
share, unless INTERNAL_TOKEN sets it. An HMAC under a fixed label: the token reveals nothing of
SECRET_KEY (which also signs sessions), and a new SECRET_KEY makes a new token.
"""

from __future__ import annotations

import hashlib
import hmac

_LABEL = b"fineserve internal token v1"


def derive_internal_token(secret_key: str) -> str:
    return hmac.new(secret_key.encode(), _LABEL, hashlib.sha256).hexdigest()


def bearer(token: str) -> str:
    """The Authorization header value that presents ``token``."""
    return f"Bearer {token}"


def presents(authorization: str | bytes | None, token: str) -> bool:
    """Whether an Authorization header carries ``token``; compared in constant time, so response
    times do not tell a guesser how much of a token was right."""
    if not authorization or not token:
        return False
    if isinstance(authorization, bytes):
        authorization = authorization.decode("latin-1")
    scheme, _, value = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), token.encode())
