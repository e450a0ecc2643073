"""The one JSON parser for what tenants send: every API body, the playground's chat, dataset lines.

Plain JSON (RFC 8259) and nothing more. Python's ``json`` and pydantic's parser both take more:
``NaN``, ``Infinity`` and ``-Infinity`` (not JSON at all), a number past a float's range read as an
infinity (``1e400``), integers of thousands of digits (Python then refuses to convert them past
4,300 digits, with a ``ValueError`` nobody expects), and nesting as deep as the stack allows
(``json`` raises ``RecursionError``). Downstream, such values make ``int()`` raise, sums turn into
NaN and databases refuse the row: a 500 instead of a 400. Here each is refused with a message that
names the field (a dotted path, as ``api_errors.invalid_fields`` writes it), before anything reads
the body. So is a NUL character in a string (``"\\u0000"``): PostgreSQL refuses it in any text, a
lookup included, and no model name, suffix or prompt needs one.

pydantic's parser (Rust, fast) does the reading: it takes the last of duplicated keys, as vLLM's
``json.loads`` does, so the gateway, the pool and vLLM read a body the same way. It refuses lone
UTF-16 surrogates (``"\\ud800"``: not Unicode text, no database or encoder takes them), raw control
characters and invalid UTF-8 itself. One quick pass over the parsed value then checks numbers and
depth (and strings, when the body holds a ``\\u0000`` escape at all).
"""

from __future__ import annotations

import math
import re
from typing import Any

import pydantic_core

from core import api_errors

# Deeper than any request of these APIs needs (a JSON schema in ``response_format`` nests two levels
# per level of the schema); code that walks a value recursively (jsonschema, serializers) stays far
# from Python's recursion limit. pydantic's parser stops at about 200 anyway.
MAX_DEPTH = 64
# What a 64-bit signed integer holds: every database column, vLLM's and torch's seeds. An integer
# beyond it is a typo or an attack; refusing it here means nothing downstream converts it.
MIN_INT, MAX_INT = -(2**63), 2**63 - 1
_NUL_ESCAPE = "\\u0000"  # the only way a NUL gets into a JSON string: raw control characters are refused


class JsonRefused(ValueError):
    """``detail`` says what is wrong; ``param`` is the dotted path of the value at fault, if any."""

    def __init__(self, detail: str, param: str | None = None):
        super().__init__(detail)
        self.detail, self.param = detail, param


def loads(raw: bytes | bytearray | str) -> Any:
    """The JSON value ``raw`` holds, or ``JsonRefused``."""
    if not raw.strip():
        raise JsonRefused("the body is empty; send a JSON object")
    try:
        # NaN and the infinities are taken here, so that the check below names the field holding one.
        value = pydantic_core.from_json(raw, allow_inf_nan=True)
    except ValueError as exc:
        raise _parser_refusal(str(exc), raw) from None
    strings = (_NUL_ESCAPE if isinstance(raw, str) else _NUL_ESCAPE.encode()) in raw  # type: ignore[operator]
    if _has_problem(value, strings):
        _name_problem(value)
    return value


def body(raw: bytes | bytearray | str) -> Any:
    """``loads`` for a request's body: what it refuses is a 400 in the API's shape."""
    try:
        return loads(raw)
    except JsonRefused as exc:
        raise api_errors.unparsable_body(exc.detail, exc.param) from None


def _parser_refusal(message: str, raw: bytes | bytearray | str) -> JsonRefused:
    if message.startswith("recursion limit exceeded"):
        return JsonRefused(f"arrays and objects nest deeper than {MAX_DEPTH} levels")
    if message.startswith("number out of range"):  # past about 4,300 digits, where the parser gives up
        field = _long_number_field(raw)
        which = f"'{field}' is a number" if field else "a number is"
        return JsonRefused(
            f"{which} too long to read ({message}); integers must lie from {MIN_INT:,} to {MAX_INT:,}", field
        )
    if "surrogate" in message or "hex escape" in message:
        return JsonRefused(f"a string holds an invalid \\u escape, such as a lone UTF-16 surrogate ({message})")
    return JsonRefused(f"not valid JSON ({message})")


_KEYED_LONG_NUMBER = re.compile(r'"([^"\\]{1,128})"\s*:\s*-?[0-9]{20}')


def _long_number_field(raw: bytes | bytearray | str) -> str | None:
    """The key of the first very long number, when it is an object's value (the parser says only where)."""
    text = raw if isinstance(raw, str) else bytes(raw).decode(errors="replace")
    found = _KEYED_LONG_NUMBER.search(text)
    return found.group(1) if found else None


def _has_problem(value: Any, strings: bool) -> bool:
    """The quick pass: whether anything is wrong at all. Walked with a list, not recursion (the walk
    itself must not be what a deep value exhausts), without the paths the second pass builds (a tuple
    per value, and a body of a megabyte holds hundreds of thousands of values)."""
    if not isinstance(value, dict | list):
        return _bad_scalar(value)
    pending: list[tuple[dict | list, int]] = [(value, 1)]
    while pending:
        container, depth = pending.pop()
        if depth > MAX_DEPTH:
            return True
        if strings and isinstance(container, dict) and any("\x00" in key for key in container):
            return True
        for child in container.values() if isinstance(container, dict) else container:
            kind = type(child)
            if kind is str:
                if strings and "\x00" in child:
                    return True
            elif kind is dict or kind is list:
                pending.append((child, depth + 1))
            elif _bad_scalar(child):
                return True
    return False


def _bad_scalar(value: Any) -> bool:
    kind = type(value)
    if kind is float:
        return not math.isfinite(value)
    if kind is int:
        return not MIN_INT <= value <= MAX_INT
    return kind is str and "\x00" in value


def _name_problem(value: Any) -> None:
    """The second pass: the first problem, by its path. Too deep a value is named by its top-level
    field (its whole path would be most of the message)."""
    pending: list[tuple[Any, tuple[str, ...]]] = [(value, ())]
    while pending:
        item, path = pending.pop()
        where = _dotted(path)
        if isinstance(item, dict | list):
            if len(path) >= MAX_DEPTH:
                field = path[0] if isinstance(value, dict) else None
                inside = f" in '{field}'" if field else ""
                raise JsonRefused(f"arrays and objects nest deeper than {MAX_DEPTH} levels{inside}", field)
            if isinstance(item, dict) and any("\x00" in key for key in item):
                raise JsonRefused(f"a key in '{where}' holds a NUL character (\\u0000), which no field takes", where)
            children = item.items() if isinstance(item, dict) else enumerate(item)
            pending.extend((child, (*path, str(key))) for key, child in children)
        elif isinstance(item, float) and not math.isfinite(item):
            what = "NaN" if math.isnan(item) else "an infinity (Infinity, -Infinity, or a number past ±1.8e308)"
            raise JsonRefused(f"'{where}' is {what}, which is not a JSON number", where)
        elif isinstance(item, int) and not isinstance(item, bool) and not MIN_INT <= item <= MAX_INT:
            raise JsonRefused(
                f"'{where}' is an integer of {item.bit_length()} bits; integers must lie from {MIN_INT:,} to {MAX_INT:,}",
                where,
            )
        elif isinstance(item, str) and "\x00" in item:
            raise JsonRefused(f"'{where}' holds a NUL character (\\u0000), which no field takes", where)
    raise AssertionError("_has_problem found a problem _name_problem did not")  # the two passes agree


def _dotted(path: tuple[str, ...]) -> str:
    return ".".join(path) or "body"
