"""DRF authentication with ``Authorization: Bearer <api key>``; request.auth is the ApiKey."""

from __future__ import annotations

from rest_framework import authentication, exceptions

from accounts.services import authenticate_key


class BearerKeyAuthentication(authentication.BaseAuthentication):
    keyword = "Bearer"

    def authenticate(self, request):
        header = authentication.get_authorization_header(request).decode(errors="replace")
        if not header:
            return None
        scheme, _, raw_key = header.partition(" ")
        if scheme != self.keyword or not raw_key.strip():
            raise exceptions.AuthenticationFailed("Use the header 'Authorization: Bearer <your API key>'.")
        api_key = authenticate_key(raw_key.strip())
        if api_key is None:
            raise exceptions.AuthenticationFailed("Incorrect API key provided, or the key has been revoked.")
        return api_key.created_by, api_key

    def authenticate_header(self, request) -> str:
        return self.keyword
