"""Which organization the signed-in user is working in (kept in the session, switchable)."""

from __future__ import annotations

from functools import wraps
from inspect import iscoroutinefunction

from asgiref.sync import sync_to_async

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest

from accounts.models import Organization

SESSION_KEY = "organization_id"


def organizations_of(user) -> list[Organization]:
    return list(Organization.objects.filter(memberships__user=user).order_by("name"))


def switch_organization(request: HttpRequest, organization_id: int) -> Organization:
    organization = next((o for o in organizations_of(request.user) if o.pk == organization_id), None)
    if organization is None:
        raise PermissionDenied("You are not a member of that organization.")
    request.session[SESSION_KEY] = organization.pk
    return organization


def _choose_organization(request: HttpRequest) -> None:
    request.organizations = organizations_of(request.user)
    if not request.organizations:
        raise PermissionDenied("Your account belongs to no organization yet: ask an administrator to add you.")
    chosen = request.session.get(SESSION_KEY)
    request.organization = next((o for o in request.organizations if o.pk == chosen), request.organizations[0])


def with_organization(view):
    """Sign-in required; sets request.organization (and request.organizations for the switcher).
    Works for async views too (the playground's streaming chat)."""

    if iscoroutinefunction(view):

        @login_required
        @wraps(view)
        async def async_wrapper(request: HttpRequest, *args, **kwargs):
            await sync_to_async(_choose_organization)(request)
            return await view(request, *args, **kwargs)

        return async_wrapper

    @login_required
    @wraps(view)
    def wrapper(request: HttpRequest, *args, **kwargs):
        _choose_organization(request)
        return view(request, *args, **kwargs)

    return wrapper
