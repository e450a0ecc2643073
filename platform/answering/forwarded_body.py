"""The body the gateway forwards to the pool: the caller's, with the fields the gateway sets.

- ``cache_salt``: the organization's own (``answering.cache_salt``), replacing any the caller sent.
- ``stream_options.include_usage`` on a stream, so that its last event reports its tokens for
  usage accounting (``usage.answers`` reads it and takes it out again when the caller did not ask).
"""

from __future__ import annotations

import json
from typing import Any


def asks_for_usage(data: dict[str, Any]) -> bool:
    options = data.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def forwarded_body(body: bytes, data: dict[str, Any], salt: str, stream: bool) -> bytes:
    """``body`` (whose parsed form is ``data``) with the gateway's fields.

    The common case costs a copy: the fields go in front of the caller's own bytes, which need no
    re-serializing. When the caller sent one of them (a later duplicate would win over ours), or
    the body does not start with ``{``, the parsed body is serialized again with ours in place.
    """
    fields: dict[str, Any] = {"cache_salt": salt}
    if stream and not asks_for_usage(data):
        options = data.get("stream_options")
        # Not an object: left as sent, for vLLM to refuse with its own message.
        if options is None or isinstance(options, dict):
            fields["stream_options"] = {**(options or {}), "include_usage": True}
    start = len(body) - len(body.lstrip(b" \t\r\n"))
    if fields.keys().isdisjoint(data) and body[start : start + 1] == b"{":
        return b"%s{%s,%s" % (body[:start], json.dumps(fields)[1:-1].encode(), body[start + 1 :])
    return json.dumps(data | fields).encode()
