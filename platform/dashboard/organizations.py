"""Which organization the signed-in user is working in (kept in the session, switchable)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import wraps
from inspect import iscoroutinefunction
from typing import Concatenate, ParamSpec, TypeVar, cast

from asgiref.sync import sync_to_async

from django.contrib.auth.decorators import login_required
from django.contrib.auth.models import User
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest
from django.http.response import HttpResponseBase

from accounts.models import Organization

SESSION_KEY = "organization_id"


class OrganizationRequest(HttpRequest):
    """What a view under ``with_organization`` receives: a signed-in request with the organization
    chosen. Only for type checking: the request is the HttpRequest the decorator was given."""

    user: User
    organization: Organization
    organizations: list[Organization]


_P = ParamSpec("_P")
_Response = TypeVar("_Response", bound=HttpResponseBase | Awaitable[HttpResponseBase])


def organizations_of(user: User) -> list[Organization]:
    return list(Organization.objects.filter(memberships__user=user).order_by("name"))


def switch_organization(request: OrganizationRequest, organization_id: int) -> Organization:
    organization = next((o for o in organizations_of(request.user) if o.pk == organization_id), None)
    if organization is None:
        raise PermissionDenied("You are not a member of that organization.")
    request.session[SESSION_KEY] = organization.pk
    return organization


def _choose_organization(http_request: HttpRequest) -> OrganizationRequest:
    request = cast(OrganizationRequest, http_request)  # login_required let only a signed-in user in
    request.organizations = organizations_of(request.user)
    if not request.organizations:
        raise PermissionDenied("Your account belongs to no organization yet: ask an administrator to add you.")
    chosen = request.session.get(SESSION_KEY)
    request.organization = next((o for o in request.organizations if o.pk == chosen), request.organizations[0])
    return request


def with_organization(
    view: Callable[Concatenate[OrganizationRequest, _P], _Response],
) -> Callable[Concatenate[HttpRequest, _P], _Response]:
    """Sign-in required; sets request.organization (and request.organizations for the switcher).
    Works for async views too (the playground's streaming chat)."""

    if iscoroutinefunction(view):

        @login_required
        @wraps(view)
        async def async_wrapper(request: HttpRequest, *args: _P.args, **kwargs: _P.kwargs) -> HttpResponseBase:
            organization_request = await sync_to_async(_choose_organization)(request)
            return await view(organization_request, *args, **kwargs)

        return cast(Callable[Concatenate[HttpRequest, _P], _Response], async_wrapper)  # _Response is the coroutine

    @login_required
    @wraps(view)
    def wrapper(request: HttpRequest, *args: _P.args, **kwargs: _P.kwargs) -> _Response:
        return view(_choose_organization(request), *args, **kwargs)

    return wrapper
