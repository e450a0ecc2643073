from django.urls import path
from rest_framework.routers import SimpleRouter

from finetuning.views import AdapterUploadView, ComposeModelView, FileViewSet, JobViewSet, ModelAdapterView

router = SimpleRouter(trailing_slash=False)
router.register("files", FileViewSet, basename="file")
router.register("fine_tuning/jobs", JobViewSet, basename="fine-tuning-job")

urlpatterns = [
    path("fine_tuning/adapters", AdapterUploadView.as_view(), name="fine-tuning-adapter-upload"),
    path("fine_tuning/models", ComposeModelView.as_view(), name="fine-tuning-model-compose"),
    path("fine_tuning/models/<path:model>/adapter", ModelAdapterView.as_view(), name="fine-tuning-model-adapter"),
    *router.urls,
]
