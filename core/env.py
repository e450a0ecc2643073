"""Strict readers for environment variables.

Every reader names the variable in its error, so a bad value stops start-up with one line that
says what to fix (the entry points print ``ConfigError`` without a traceback).
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class ConfigError(Exception):
    """A setting that cannot be used; the message names the variable and the fix."""


def env_str(name: str, default: str) -> str:
    return os.environ.get(name, default)


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{name}={raw!r} is not a boolean: use one of true/false, 1/0, yes/no, on/off")


def env_int(name: str, default: int, minimum: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a whole number") from None
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name}={value} is too small: it must be at least {minimum}")
    return value


def env_list(name: str, default: str) -> list[str]:
    """A comma-separated list; blanks are dropped so a trailing comma is harmless."""
    return [item.strip() for item in os.environ.get(name, default).split(",") if item.strip()]


def env_url(name: str, default: str, schemes: tuple[str, ...]) -> str:
    raw = os.environ.get(name, default)
    parts = urlsplit(raw)
    if parts.scheme not in schemes or not (parts.netloc or parts.path):
        allowed = ", ".join(f"{scheme}://" for scheme in schemes)
        raise ConfigError(f"{name}={raw!r} is not a usable URL: it must start with one of {allowed}")
    return raw


_MIN_TOKEN_CHARS = 32


def env_token(name: str) -> str:
    """A shared secret sent in an HTTP header: empty (unset), or at least 32 visible ASCII
    characters without spaces (a short one can be guessed; a space or newline breaks the header)."""
    raw = os.environ.get(name, "")
    if not raw:
        return ""
    if len(raw) < _MIN_TOKEN_CHARS or not all("!" <= char <= "~" for char in raw):
        raise ConfigError(
            f"{name} must be at least {_MIN_TOKEN_CHARS} visible ASCII characters without spaces "
            "(for example: openssl rand -hex 32), or empty"
        )
    return raw


def env_path(name: str, default: Path) -> Path:
    raw = os.environ.get(name)
    return Path(raw).expanduser().resolve() if raw else default
