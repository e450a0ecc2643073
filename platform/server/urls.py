from django.urls import include, path, re_path
from drf_spectacular.views import SpectacularAPIView, SpectacularRedocView

from base.error_responses import unknown_api_path
from health.views import healthz
from server.canonical_paths import without_trailing_slash

urlpatterns = [
    path("healthz", healthz, name="healthz"),
    path("", include("gateway.urls")),
    path("v1/", include("finetuning.urls")),
    path("v1/", include("evals.urls")),
    path("v1/", include("batches.urls")),
    path("v1/", include("usage.urls")),
    path("v1/", include("webhooks.urls")),
    # Any other /v1/ path is a JSON 404 in every mode (with DEBUG=true Django would not use handler404).
    re_path(r"^v1/", unknown_api_path),
    path("api/v1/", include("training_loops.urls")),  # the Tinker SDK's protocol
    path("api/schema", SpectacularAPIView.as_view(), name="openapi-schema"),
    path("api/docs", SpectacularRedocView.as_view(url_name="openapi-schema"), name="api-docs"),
    path("", include("dashboard.urls")),
    # Last: a path with a trailing slash that matched nothing above (server.canonical_paths).
    re_path(r"^.+/$", without_trailing_slash),
]

handler400 = "base.error_responses.bad_request"
handler403 = "base.error_responses.permission_denied"
handler404 = "base.error_responses.page_not_found"
handler500 = "base.error_responses.server_error"
