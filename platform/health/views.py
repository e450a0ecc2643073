from django.http import HttpRequest, JsonResponse
from django.views.decorators.http import require_GET

from base.monitoring import from_monitoring
from health.checks import ALL_CHECKS


@require_GET
def healthz(request: HttpRequest) -> JsonResponse:
    """Up or down for anyone (a load balancer); which part is down, and why, for monitoring only."""
    results = {name: check() for name, check in ALL_CHECKS.items()}
    healthy = all(result.ok for result in results.values())
    body: dict[str, object] = {"status": "ok" if healthy else "unavailable"}
    if from_monitoring(request):
        body["checks"] = {name: {"ok": r.ok, "detail": r.detail} for name, r in results.items()}
        body["down"] = [name for name, result in results.items() if not result.ok]
    return JsonResponse(body, status=200 if healthy else 503)
