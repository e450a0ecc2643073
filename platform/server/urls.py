from django.urls import include, path, re_path
from drf_spectacular.views import SpectacularAPIView, SpectacularRedocView

from health.views import healthz
from server.canonical_paths import without_trailing_slash
from server.api_errors import unknown_api_path

urlpatterns = [
    path("healthz", healthz, name="healthz"),
    path("", include("gateway.urls")),
    path("v1/", include("finetuning.urls")),
    path("v1/", include("usage.urls")),
    # Any other /v1/ path is a JSON 404 in every mode (with DEBUG=true Django would not use handler404).
    re_path(r"^v1/", unknown_api_path),
    path("api/schema", SpectacularAPIView.as_view(), name="openapi-schema"),
    path("api/docs", SpectacularRedocView.as_view(url_name="openapi-schema"), name="api-docs"),
    path("", include("dashboard.urls")),
    # Last: a path with a trailing slash that matched nothing above (server.canonical_paths).
    re_path(r"^.+/$", without_trailing_slash),
]

handler400 = "server.api_errors.bad_request"
handler403 = "server.api_errors.permission_denied"
handler404 = "server.api_errors.page_not_found"
handler500 = "server.api_errors.server_error"
