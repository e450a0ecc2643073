"""How often one username, or one client address, may try to sign in (``core.rate_limits``).

Failed attempts are counted, per username and per address, in a window that starts at the first
one; past SIGN_IN_FAILURES the next attempt is refused before its password is checked, until the
window ends. Each attempt is charged before its password is checked (so attempts at once cannot
pass the limit together) and refunded when it succeeds. A success also clears its username's
failures, but not its address's: one account of one's own must not buy more guesses at others'
from the same address. Like every rate, it is not
enforced while Redis is down (logged): the dashboard stays usable, and each guess still costs a
slow password hash.

The address is REMOTE_ADDR, which the web server (uvicorn) takes from X-Forwarded-For when the
connection comes from a trusted proxy (FORWARDED_ALLOW_IPS, the same machine by default).
"""

from __future__ import annotations

import hashlib

from django.conf import settings

from core.config import LIMIT_SETTINGS
from core.rate_limits import Exceeded, Limit, charge, refund, reset


def _limits(username: str, address: str) -> list[Limit]:
    limits = settings.CONFIG.limits
    describe = f"{limits.sign_in_failures} sign-in attempts in {_duration(limits.sign_in_window_s)}"
    setting = LIMIT_SETTINGS["sign_in_failures"]
    counters = (f"sign-in:user:{_digest(username.strip().lower())}", f"sign-in:address:{_digest(address)}")
    return [Limit(counter, limits.sign_in_failures, limits.sign_in_window_s, describe, setting) for counter in counters]


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]  # a bounded key, whatever was typed


def attempt(username: str, address: str) -> Exceeded | None:
    """Count an attempt as a failure until it succeeds; when the username or the address is over its
    limit, when to try again."""
    return charge(settings.CONFIG.redis_url, _limits(username, address))


def succeeded(username: str, address: str) -> None:
    per_username, per_address = _limits(username, address)
    reset(settings.CONFIG.redis_url, [per_username])
    refund(settings.CONFIG.redis_url, [per_address])


def refusal_message(exceeded: Exceeded) -> str:
    return (
        f"Too many sign-in attempts for this username or from this address (at most {exceeded.limit.describe}). "
        f"Try again in {_duration(exceeded.retry_after_s)}."
    )


def _duration(seconds: int) -> str:
    if seconds < 120:
        return f"{seconds} seconds"
    return f"{-(-seconds // 60)} minutes"
