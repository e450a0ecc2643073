from rest_framework.routers import SimpleRouter

from finetuning.views import FileViewSet, JobViewSet

router = SimpleRouter(trailing_slash=False)
router.register("files", FileViewSet, basename="file")
router.register("fine_tuning/jobs", JobViewSet, basename="fine-tuning-job")

urlpatterns = router.urls
