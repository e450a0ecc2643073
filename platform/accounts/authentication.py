"""DRF authentication with ``Authorization: Bearer <api key>``; request.auth is the ApiKey."""

from __future__ import annotations

from typing import cast

from django.contrib.auth.models import User
from rest_framework import authentication, exceptions
from rest_framework.request import Request

from accounts.models import ApiKey, Organization
from accounts.services import authenticate_key


class BearerKeyAuthentication(authentication.BaseAuthentication):
    keyword = "Bearer"

    def authenticate(self, request: Request) -> tuple[User, ApiKey] | None:
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

    def authenticate_header(self, request: Request) -> str:
        return self.keyword


# An API view is reached only through this class (the default authentication, with IsAuthenticated
# as the default permission), so its request.auth is the ApiKey and its request.user the key's maker.
def organization_of(request: Request) -> Organization:
    """The organization an API request acts for: its key's."""
    return cast(ApiKey, request.auth).organization


def caller_of(request: Request) -> User:
    """Who made the key that signed an API request."""
    return cast(User, request.user)
