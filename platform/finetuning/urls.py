from django.urls import path
from rest_framework.routers import SimpleRouter

from finetuning.views import (
    AdapterUploadView,
    ComposeModelView,
    CompositionViewSet,
    FileViewSet,
    JobViewSet,
    ModelAdapterView,
    ModelRevisionsView,
    ModelRollbackView,
)

router = SimpleRouter(trailing_slash=False)
router.register("files", FileViewSet, basename="file")
router.register("fine_tuning/jobs", JobViewSet, basename="fine-tuning-job")
router.register("fine_tuning/compositions", CompositionViewSet, basename="fine-tuning-composition")

urlpatterns = [
    path("fine_tuning/adapters", AdapterUploadView.as_view(), name="fine-tuning-adapter-upload"),
    path("fine_tuning/models", ComposeModelView.as_view(), name="fine-tuning-model-compose"),
    path("fine_tuning/models/<path:model>/adapter", ModelAdapterView.as_view(), name="fine-tuning-model-adapter"),
    path("fine_tuning/models/<path:model>/revisions", ModelRevisionsView.as_view(), name="fine-tuning-model-revisions"),
    path("fine_tuning/models/<path:model>/rollback", ModelRollbackView.as_view(), name="fine-tuning-model-rollback"),
    *router.urls,
]
