"""Whole numbers typed by people: query parameters and form fields.

``int(text)`` is not enough: ``str.isdigit`` also takes "²" and other digits ``int`` refuses, and
Python refuses to convert more than 4,300 digits (a ``ValueError`` nobody expects, so a 500). Here
a value is ASCII digits, compared by length before it is converted, and within the bounds the
caller gives; anything else is None, for the caller to refuse in its own words, naming the field.
"""

from __future__ import annotations


def whole_number(text: str, low: int, high: int) -> int | None:
    """``text`` as a whole number from ``low`` (at least 0) to ``high``, or None if it is not one."""
    if not (text.isascii() and text.isdigit()):
        return None
    digits = text.lstrip("0") or "0"  # leading zeros count against Python's limit too
    if len(digits) > len(str(high)):
        return None
    value = int(digits)
    return value if low <= value <= high else None
