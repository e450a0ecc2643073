"""OpenAI's grader templates: ``{{item.<path>}}`` and ``{{sample.<path>}}`` inside a grader's text,
replaced by the values they name. Substituted as text, never evaluated: a path is looked up one
dict key or list index at a time on plain JSON data, never with ``getattr``, so
``{{item.__class__}}`` is simply a key the item does not have.

A path is dotted identifiers and list indices, ``item.answer.steps.0`` (``[0]`` is taken too), with
whitespace allowed inside the braces (``{{ item.answer }}``), as OpenAI's graders guide writes them.
The roots are OpenAI's two namespaces: ``item`` (the dataset row or eval item) and ``sample`` (the
model's answer: ``output_text``, ``output_json``, ``output_tools``, ``choices``; see
``core.graders.engine.sample_of``).
"""

from __future__ import annotations

import json
import re

ROOTS = ("item", "sample")
# What one substitution may produce at most: a template repeating a large field (say, 10,000
# references to a 100 kB answer) would otherwise build gigabytes. Longer is cut at this length.
MAX_RENDERED_CHARS = 100_000

_REFERENCE = re.compile(r"\{\{(.*?)\}\}", re.DOTALL)
_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.(?:[A-Za-z_][A-Za-z0-9_]*|\d+)|\[\d+\])*")
_STEP = re.compile(r"\.?([A-Za-z_][A-Za-z0-9_]*|\d+)|\[(\d+)\]")


def template_problem(text: str) -> str | None:
    """None when every ``{{ }}`` in ``text`` names a value by a path this module reads; otherwise
    what to fix, about the first one that does not."""
    for match in _REFERENCE.finditer(text):
        inner = match.group(1).strip()
        if not _PATH.fullmatch(inner):
            return (
                f"the template {_shown(match.group(0))} is not a reference like {{{{item.field}}}} or "
                "{{sample.output_text}}: a namespace, then dotted names or list indices"
            )
        root = re.split(r"[.\[]", inner, maxsplit=1)[0]
        if root not in ROOTS:
            return f"the template {_shown(match.group(0))} starts with {root!r}; the namespaces are item and sample"
        if inner == root:
            return (
                f"the template {_shown(match.group(0))} names a whole namespace; name a field in it, like {root}.field"
            )
    unclosed = text.find("{{", _last_end(text))
    if unclosed != -1:
        return f"the text has a {{{{ at character {unclosed} with no }}}} after it"
    return None


def substitute(text: str, item: dict, sample: dict | None) -> str:
    """``text`` with each reference replaced by its value: a string as it is, any other JSON value as
    compact JSON. A missing value (no such key or index, or a JSON null) renders as the empty
    string, not an error: one row lacking an optional field should score that row (a string check
    then simply fails), not stop a whole eval run or training job; ``template_problem`` already
    caught references that can never be right. The result is cut at ``MAX_RENDERED_CHARS``."""
    namespaces: dict[str, object] = {"item": item, "sample": sample}
    parts: list[str] = []
    room = MAX_RENDERED_CHARS
    position = 0
    for match in _REFERENCE.finditer(text):
        for piece in (text[position : match.start()], _rendered(_value(namespaces, match.group(1).strip()))):
            parts.append(piece[:room])
            room -= len(parts[-1])
        if room <= 0:
            return "".join(parts)
        position = match.end()
    parts.append(text[position:][:room])
    return "".join(parts)


def _value(namespaces: dict[str, object], path: str) -> object:
    """The value at ``path`` (``item.a.0``), or None where any step finds nothing."""
    if not _PATH.fullmatch(path):
        return None
    steps = _STEP.findall(path)
    value: object = namespaces.get(steps[0][0])
    for name, bracketed in steps[1:]:
        step = bracketed or name
        if isinstance(value, dict):
            value = value.get(step)
        elif isinstance(value, list) and step.isdigit():
            index = int(step)
            value = value[index] if index < len(value) else None
        else:
            return None
    return value


def _rendered(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError, RecursionError):
        # NaN, an integer past Python's 4,300-digit conversion limit, something not JSON, nesting
        # past the stack: no text stands for it, so it renders as missing.
        return ""


def _last_end(text: str) -> int:
    ends = [match.end() for match in _REFERENCE.finditer(text)]
    return ends[-1] if ends else 0


def _shown(reference: str) -> str:
    return reference if len(reference) <= 60 else f"{reference[:57]}..."
