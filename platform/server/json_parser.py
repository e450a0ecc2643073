"""The API's JSON parser: DRF's, reading with ``core.strict_json`` (plain JSON only: a NaN, an
integer of thousands of digits or a body nested 100,000 deep is a 400 naming the field, not a 500).

``settings.REST_FRAMEWORK["DEFAULT_PARSER_CLASSES"]`` names it for every DRF view."""

from __future__ import annotations

from collections.abc import Mapping
from typing import IO, Any

from rest_framework.parsers import JSONParser

from core import strict_json


class StrictJSONParser(JSONParser):
    def parse(
        self, stream: IO[Any], media_type: str | None = None, parser_context: Mapping[str, Any] | None = None
    ) -> Any:
        # The body is already capped (``server.body_limits``); JSON is UTF-8 (RFC 8259), and a
        # body in another encoding is refused as invalid UTF-8 rather than read as something else.
        return strict_json.body(stream.read())
