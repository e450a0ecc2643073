from django.urls import path

from usage.views import CompletionsUsageView, FineTuningUsageView

urlpatterns = [
    path("organization/usage/completions", CompletionsUsageView.as_view(), name="usage-completions"),
    path("organization/usage/fine_tuning", FineTuningUsageView.as_view(), name="usage-fine-tuning"),
]
