"""The prompt an eval run's model answers for an item, from the run's ``input_messages``:
- ``{"type": "template", "template": [{"role", "content"}, ...]}``: each message's text with
  ``{{item.*}}`` substituted (``core.graders.template``: as text, never evaluated), a ``developer``
  message sent as ``system`` (the chat templates of the models served here know system, user and
  assistant; a judge's prompt is sent the same way, ``core.graders.judging``);
- ``{"type": "item_reference", "item_reference": "item.input"}``: the item's own messages, at that path.
"""

from __future__ import annotations

from typing import Any

from core.graders.template import substitute, template_problem

DEFAULT_INPUT = {"type": "item_reference", "item_reference": "item.input"}  # a chat file's items hold their prompt there
ROLES = ("user", "assistant", "system", "developer")


def input_messages_problem(input_messages: dict) -> tuple[str, str] | None:
    """What is wrong with a run's ``input_messages``, as (the field under it, what to fix); None when fine."""
    if input_messages["type"] == "template":
        if not input_messages.get("template"):
            return "template", "give the messages of the prompt, with {{item.<field>}} where the item's values go"
        for index, message in enumerate(input_messages["template"]):
            problem = template_problem(_text(message["content"]))
            if problem is not None:
                return f"template.{index}.content", problem
        return None
    reference = input_messages.get("item_reference") or ""
    if not reference.startswith("item.") or template_problem(f"{{{{{reference}}}}}") is not None:
        return "item_reference", f"{reference[:100]!r} is not a path in the item: write item.<field>, like item.input"
    return None


def prompt_of(input_messages: dict, item: dict) -> tuple[list[dict] | None, str | None]:
    """The chat messages for ``item``, or what is wrong (an item_reference that holds no messages)."""
    if input_messages["type"] == "template":
        return [{"role": _role(message["role"]), "content": substitute(_text(message["content"]), item, None)}
                for message in input_messages["template"]], None
    reference = input_messages["item_reference"]
    value, found = _at(item, reference.removeprefix("item.").split("."))
    if not reference.startswith("item.") or not found:
        return None, f"{reference} names nothing in the item: give item_reference as item.<the field with the messages>"
    return _messages(value, reference)


def _role(role: str) -> str:
    return "system" if role == "developer" else role


def _text(content: Any) -> str:
    """A template message's content: a string, a text part, or a list of them (their texts joined)."""
    parts = content if isinstance(content, list) else [content]
    return "".join(part if isinstance(part, str) else str(part.get("text", "")) for part in parts)


def _at(value: Any, path: list[str]) -> tuple[Any, bool]:
    """The value at ``path`` (keys of objects, indices of lists): plain data only, never attributes."""
    for key in path:
        if isinstance(value, dict) and key in value:
            value = value[key]
        elif isinstance(value, list) and key.isdigit() and int(key) < len(value):
            value = value[int(key)]
        else:
            return None, False
    return value, True


def _messages(value: Any, reference: str) -> tuple[list[dict] | None, str | None]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}], None  # a question as text: the user's
    if not isinstance(value, list) or not value:
        return None, f"{reference} must hold a list of messages ({{\"role\", \"content\"}}) or a text"
    messages = []
    for index, message in enumerate(value):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            return None, f"{reference}.{index} must be a message with a role ({', '.join(ROLES)})"
        messages.append({"role": _role(message["role"]), "content": _text(message.get("content") or "")})
    return messages, None
