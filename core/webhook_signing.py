"""Standard Webhooks signatures (https://www.standardwebhooks.com), which OpenAI's webhooks use.

A secret is ``whsec_`` and the base64 of random bytes; the receiver keeps it. Each delivery carries
``webhook-id`` (the message id: the same on every retry of one event to one endpoint, so receivers
can drop a repeat), ``webhook-timestamp`` (unix seconds, when this attempt was signed: receivers
refuse old ones, against replays) and ``webhook-signature``: ``v1,`` and the base64 of
HMAC-SHA256(the secret's bytes, ``"{id}.{timestamp}.{body}"``).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets

SECRET_PREFIX = "whsec_"
SECRET_BYTES = 32  # the standard asks for 24 to 64


def new_secret() -> str:
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode()


def signature(secret: str, message_id: str, timestamp: int, body: bytes) -> str:
    key = base64.b64decode(secret.removeprefix(SECRET_PREFIX))
    signed = f"{message_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()


def signed_headers(secret: str, message_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    return {
        "webhook-id": message_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": signature(secret, message_id, timestamp, body),
    }
