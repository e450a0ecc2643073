from django.contrib.auth import views as auth_views
from django.urls import path
from django.views.generic import RedirectView

from dashboard import batch_pages, eval_pages, views, webhook_pages
from dashboard.sign_in import SignInView

app_name = "dashboard"

urlpatterns = [
    path("", RedirectView.as_view(pattern_name="dashboard:jobs"), name="home"),
    path("login", SignInView.as_view(), name="login"),
    path("logout", auth_views.LogoutView.as_view(), name="logout"),
    path("organization", views.switch, name="switch"),
    path("datasets", views.datasets, name="datasets"),
    path("datasets/<str:file_id>", views.dataset, name="dataset"),
    path("datasets/<str:file_id>/delete", views.dataset_delete, name="dataset_delete"),
    path("jobs", views.job_list, name="jobs"),
    path("jobs/new", views.job_new, name="job_new"),
    path("jobs/<str:job_id>", views.job_detail, name="job"),
    path("jobs/<str:job_id>/progress", views.job_progress, name="job_progress"),
    path("jobs/<str:job_id>/cancel", views.job_cancel, name="job_cancel"),
    path(
        "jobs/<str:job_id>/checkpoints/<str:checkpoint_id>/adapter", views.checkpoint_adapter, name="checkpoint_adapter"
    ),
    path("models", views.models, name="models"),
    path("models/upload", views.adapter_upload, name="adapter_upload"),
    path("models/compose", views.model_compose, name="model_compose"),
    # A fine-tuned model by its name, <base_model_id>:<suffix>: the base model id holds a slash.
    path("models/<path:model_name>/delete", views.model_delete, name="model_delete"),
    path("models/<path:model_name>/adapter", views.model_adapter, name="model_adapter"),
    path("models/<path:model_name>/rollback", views.model_rollback, name="model_rollback"),
    path("models/<path:model_name>/compare/base", eval_pages.model_compare_base, name="model_compare_base"),
    path("models/<path:model_name>/compare/revisions", eval_pages.model_compare_revisions, name="model_compare_revisions"),
    path("evals", eval_pages.eval_list, name="evals"),
    path("evals/<str:eval_id>", eval_pages.eval_detail, name="eval"),
    path("evals/<str:eval_id>/runs/<str:run_id>/cancel", eval_pages.eval_run_cancel, name="eval_run_cancel"),
    path("batches", batch_pages.batch_list, name="batches"),
    path("batches/<str:batch_id>/files/<str:kind>", batch_pages.batch_file, name="batch_file"),
    path("playground", views.playground, name="playground"),
    path("playground/chat", views.playground_chat, name="playground_chat"),
    path("usage", views.usage, name="usage"),
    path("keys", views.api_keys, name="api_keys"),
    # A key by the prefix the page shows (``accounts.services.create_api_key`` keeps it unique in its organization).
    path("keys/<str:key_prefix>/revoke", views.api_key_revoke, name="api_key_revoke"),
    path("organization/members", views.members_may_manage, name="members_may_manage"),
    path("webhooks", webhook_pages.webhook_list, name="webhooks"),
    path("webhooks/<str:webhook_id>", webhook_pages.webhook_detail, name="webhook"),
    path("webhooks/<str:webhook_id>/enabled", webhook_pages.webhook_enabled, name="webhook_enabled"),
    path("webhooks/<str:webhook_id>/delete", webhook_pages.webhook_delete, name="webhook_delete"),
]
