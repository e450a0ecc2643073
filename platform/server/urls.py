from django.urls import include, path

from health.views import healthz

urlpatterns = [
    path("healthz", healthz, name="healthz"),
    path("", include("gateway.urls")),
]
