"""The dashboard's webhooks pages: register an endpoint (its secret shown once), list, enable or
disable and delete them, and an endpoint's delivery log. Each view parses, calls one function of
the webhooks app (the one the API calls), and renders or redirects."""

from __future__ import annotations

from django.contrib import messages
from django.core.paginator import Paginator
from django.http import HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from core.api_errors import ApiError
from dashboard.forms import WebhookForm, show_api_error
from dashboard.organizations import OrganizationRequest, with_organization
from webhooks import endpoints
from webhooks.delivery import MAX_ATTEMPTS
from webhooks.models import WebhookEndpoint

ENDPOINTS_PER_PAGE = 50
DELIVERIES_PER_PAGE = 25


def _own(request: OrganizationRequest, webhook_id: str) -> WebhookEndpoint:
    return get_object_or_404(WebhookEndpoint.objects.for_org(request.organization), pk=webhook_id)


@with_organization
def webhook_list(request: OrganizationRequest) -> HttpResponse:
    form, new_secret, created = WebhookForm(request.POST if request.method == "POST" else None), None, None
    if request.method == "POST" and form.is_valid():
        try:
            created, new_secret = endpoints.register(request.organization, request.user, **form.cleaned_data)
        except ApiError as error:
            show_api_error(form, error)
        else:
            form = WebhookForm()
    listing = WebhookEndpoint.objects.for_org(request.organization)
    page = Paginator(listing, ENDPOINTS_PER_PAGE).get_page(request.GET.get("page"))
    context = {"form": form, "page": page, "new_secret": new_secret, "created": created}
    return render(request, "dashboard/webhooks.html", context)


@with_organization
def webhook_detail(request: OrganizationRequest, webhook_id: str) -> HttpResponse:
    endpoint = _own(request, webhook_id)
    deliveries = endpoint.deliveries.select_related("event").prefetch_related("attempt_log")
    page = Paginator(deliveries, DELIVERIES_PER_PAGE).get_page(request.GET.get("page"))
    return render(request, "dashboard/webhook.html", {"endpoint": endpoint, "page": page, "max_attempts": MAX_ATTEMPTS})


@require_POST
@with_organization
def webhook_enabled(request: OrganizationRequest, webhook_id: str) -> HttpResponse:
    """A check box: without ``enabled=on`` the endpoint is disabled."""
    endpoint = endpoints.set_enabled(_own(request, webhook_id), request.POST.get("enabled") == "on")
    messages.success(request, f"{endpoint.url} is {'enabled' if endpoint.enabled else 'disabled'}.")
    return redirect("dashboard:webhook", webhook_id=webhook_id)


@require_POST
@with_organization
def webhook_delete(request: OrganizationRequest, webhook_id: str) -> HttpResponse:
    endpoint = _own(request, webhook_id)
    endpoints.remove(endpoint)
    messages.success(request, f"Deleted the endpoint {endpoint.url}: it receives nothing more.")
    return redirect("dashboard:webhooks")
