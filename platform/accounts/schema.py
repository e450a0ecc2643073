"""Tell the OpenAPI schema how API keys are sent (drf-spectacular finds this on import)."""

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class BearerKeyScheme(OpenApiAuthenticationExtension):
    target_class = "accounts.authentication.BearerKeyAuthentication"
    name = "apiKey"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "description": "Authorization: Bearer <API key>"}
