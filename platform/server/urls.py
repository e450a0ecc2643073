from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularRedocView

from health.views import healthz

urlpatterns = [
    path("healthz", healthz, name="healthz"),
    path("", include("gateway.urls")),
    path("v1/", include("finetuning.urls")),
    path("api/schema", SpectacularAPIView.as_view(), name="openapi-schema"),
    path("api/docs", SpectacularRedocView.as_view(url_name="openapi-schema"), name="api-docs"),
    path("", include("dashboard.urls")),
]

handler404 = "server.errors.not_found"
