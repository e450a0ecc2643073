from django.urls import path

from batches.views import BatchCancelView, BatchDetailView, BatchListView

urlpatterns = [
    path("batches", BatchListView.as_view(), name="batch-list"),
    path("batches/<str:batch_id>", BatchDetailView.as_view(), name="batch-detail"),
    path("batches/<str:batch_id>/cancel", BatchCancelView.as_view(), name="batch-cancel"),
]
