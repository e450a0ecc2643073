"""The OpenAI-compatible inference endpoints and the platform's Prometheus metrics."""

from django.urls import path

from gateway import views

urlpatterns = [
    path("v1/chat/completions", views.chat_completions, name="chat-completions"),
    path("v1/completions", views.completions, name="completions"),
    path("v1/responses", views.responses, name="responses"),
    path("v1/responses/<str:response_id>", views.response, name="response"),
    path("v1/models", views.list_models, name="models"),
    path("v1/models/<path:model>", views.model, name="model"),
    path("metrics", views.metrics, name="metrics"),
]
