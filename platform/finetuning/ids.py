"""OpenAI-shaped object ids: a type prefix and 24 random characters (``ftjob-abc...``)."""

import secrets
import string

_ALPHABET = string.ascii_letters + string.digits


def new_id(prefix: str) -> str:
    return prefix + "-" + "".join(secrets.choice(_ALPHABET) for _ in range(24))
