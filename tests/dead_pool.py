"""The web application through both of the gateway's entry points (the fast path and the Django
views), with no pool behind it: a request the gateway accepts ends in a 503 from the unreachable
pool. And two organizations with a key each."""

from __future__ import annotations

import httpx
import pytest

DEAD_POOL = "http://127.0.0.1:9"  # the discard port: nothing listens there


@pytest.fixture(params=["fast path", "django views"])
def web(request, settings):
    """An httpx client on the web application, through one entry point or the other."""
    from django.core.asgi import get_asgi_application
    from gateway.asgi import with_fast_path

    settings.INFERENCE_POOL_URL = DEAD_POOL
    application = get_asgi_application()
    if request.param == "fast path":
        application = with_fast_path(application)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=application), base_url="http://testserver")


@pytest.fixture
def keys(transactional_db):
    """alice's organization owns a fine-tuned model; charlie's is an outsider."""
    from accounts.services import create_api_key, create_organization
    from django.contrib.auth.models import User

    result = {}
    for name in ("alice", "charlie"):
        user = User.objects.create_user(name)
        organization = create_organization(f"{name} lab", user)
        result[name] = create_api_key(organization, user, "tests")[1]
        result[f"{name}_org"] = organization
    return result
