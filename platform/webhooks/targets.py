"""Which URLs an endpoint may have: checked when it is registered or changed, with a 400 that says
what is wrong. The sender checks the addresses again at every attempt (``core.webhook_http``): a
name's addresses can change after registration."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from django.conf import settings

from core.api_errors import ApiError, shown
from core.config import WEBHOOKS_PRIVATE_SETTING
from core.public_addresses import LOOPBACK, literal, refusal

MAX_URL_CHARS = 2048
_HOST_NAME = re.compile(
    r"^(?=.{1,253}$)([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*\.?$"
)
_CONTROL_OR_SPACE = re.compile(r"[\x00-\x20\x7f]")


def allow_private() -> bool:
    return bool(settings.WEBHOOKS_ALLOW_PRIVATE_ADDRESSES)


def _refused(reason: str) -> ApiError:
    return ApiError(f"url: {reason}", param="url", code="invalid_url")


def checked_url(url: str) -> str:
    """``url`` when an endpoint may have it; otherwise the 400 that says why."""
    if len(url) > MAX_URL_CHARS:
        raise _refused(f"at most {MAX_URL_CHARS:,} characters, not {len(url):,}")
    if _CONTROL_OR_SPACE.search(url):
        raise _refused("spaces, NUL and other control characters are not allowed in a URL")
    schemes = ("https", "http") if allow_private() else ("https",)
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 -- raises ValueError for a port out of range or not a number
    except ValueError as exc:
        raise _refused(f"'{shown(url)}' is not a URL ({exc})") from None
    if parts.scheme.lower() not in schemes:
        plain = "" if allow_private() else f" (plain http:// only where the operator sets {WEBHOOKS_PRIVATE_SETTING})"
        raise _refused(f"must start with {' or '.join(f'{s}://' for s in schemes)}, not '{shown(url)}'{plain}")
    if parts.username is not None or parts.password is not None:
        raise _refused("must not hold a user name or password: the signature authenticates each delivery")
    if parts.fragment:
        raise _refused("must not have a #fragment (it is never sent)")
    host = (parts.hostname or "").lower()
    if not host:
        raise _refused(f"names no host: '{shown(url)}'")
    _check_host(host)
    return url


def _check_host(host: str) -> None:
    address = literal(host)
    if address is not None:
        why = refusal(address, allow_private())
    elif not _HOST_NAME.match(host):
        raise _refused(f"'{shown(host)}' is not a host name")
    elif host.rstrip(".") == "localhost" or host.rstrip(".").endswith(".localhost"):
        why = None if allow_private() else f"a {LOOPBACK} address"
    else:
        return  # a name: its addresses are checked at every send
    if why:
        raise _refused(
            f"'{shown(host)}' is {why}; webhooks go only to public addresses (the operator may allow "
            f"private and loopback ones: {WEBHOOKS_PRIVATE_SETTING})"
        )
