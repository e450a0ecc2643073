"""Tell the OpenAPI schema how API keys are sent (drf-spectacular finds this on import)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from drf_spectacular.extensions import OpenApiAuthenticationExtension

if TYPE_CHECKING:
    from drf_spectacular.openapi import AutoSchema


class BearerKeyScheme(OpenApiAuthenticationExtension):
    target_class = "accounts.authentication.BearerKeyAuthentication"
    name = "apiKey"

    def get_security_definition(self, auto_schema: AutoSchema) -> dict[str, str]:
        return {"type": "http", "scheme": "bearer", "description": "Authorization: Bearer <API key>"}
