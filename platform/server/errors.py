"""Django's 404 page: JSON in the API's shape under /v1/, a page for people elsewhere."""

from django.shortcuts import render

from server.api_errors import json_404


def not_found(request, exception=None):
    if request.path.startswith("/v1/"):
        return json_404(request, exception)
    return render(request, "404.html", {"path": request.path}, status=404)
