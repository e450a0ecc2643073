from django.urls import path

from webhooks.views import DeliveryListView, EndpointDetailView, EndpointListView

urlpatterns = [
    path("webhooks", EndpointListView.as_view(), name="webhook-list"),
    path("webhooks/<str:webhook_id>", EndpointDetailView.as_view(), name="webhook-detail"),
    path("webhooks/<str:webhook_id>/deliveries", DeliveryListView.as_view(), name="webhook-deliveries"),
]
