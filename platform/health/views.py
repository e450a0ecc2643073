from django.http import JsonResponse
from django.views.decorators.http import require_GET

from health.checks import ALL_CHECKS


@require_GET
def healthz(request):
    results = {name: check() for name, check in ALL_CHECKS.items()}
    healthy = all(result.ok for result in results.values())
    body = {
        "status": "ok" if healthy else "unavailable",
        "checks": {name: {"ok": r.ok, "detail": r.detail} for name, r in results.items()},
        "down": [name for name, result in results.items() if not result.ok],
    }
    return JsonResponse(body, status=200 if healthy else 503)
