from django.urls import path

from evals import grader_views
from evals.views import (
    EvalDetailView,
    EvalListView,
    OutputItemDetailView,
    OutputItemListView,
    RunCancelView,
    RunDetailView,
    RunListView,
)

_RUN = "evals/<str:eval_id>/runs/<str:run_id>"

urlpatterns = [
    path("fine_tuning/alpha/graders/run", grader_views.run, name="graders-run"),
    path("fine_tuning/alpha/graders/validate", grader_views.GraderValidateView.as_view(), name="graders-validate"),
    path("evals", EvalListView.as_view(), name="eval-list"),
    path("evals/<str:eval_id>", EvalDetailView.as_view(), name="eval-detail"),
    path("evals/<str:eval_id>/runs", RunListView.as_view(), name="eval-run-list"),
    path(_RUN, RunDetailView.as_view(), name="eval-run-detail"),
    path(f"{_RUN}/cancel", RunCancelView.as_view(), name="eval-run-cancel"),
    path(f"{_RUN}/output_items", OutputItemListView.as_view(), name="eval-run-output-items"),
    path(f"{_RUN}/output_items/<str:item_id>", OutputItemDetailView.as_view(), name="eval-run-output-item"),
]
