from django.urls import path, re_path

from training_loops import views

# The Tinker SDK's paths (``tinker/resources``), under /api/v1/.
urlpatterns = [
    path("healthz", views.healthz, name="tinker-healthz"),
    path("telemetry", views.telemetry, name="tinker-telemetry"),
    path("client/config", views.client_config, name="tinker-client-config"),
    path("get_server_capabilities", views.server_capabilities, name="tinker-server-capabilities"),
    path("create_session", views.create_session, name="tinker-create-session"),
    path("session_heartbeat", views.session_heartbeat, name="tinker-session-heartbeat"),
    path("sessions/<str:session_id>/finish", views.finish_session, name="tinker-finish-session"),
    path("create_model", views.create_model, name="tinker-create-model"),
    path("get_info", views.get_info, name="tinker-get-info"),
    path("forward_backward", views.forward_backward, name="tinker-forward-backward"),
    path("optim_step", views.optim_step, name="tinker-optim-step"),
    path("save_weights", views.save_weights, name="tinker-save-weights"),
    path("save_weights_for_sampler", views.save_weights_for_sampler, name="tinker-save-weights-for-sampler"),
    path("load_weights", views.load_weights, name="tinker-load-weights"),
    path("create_sampling_session", views.create_sampling_session, name="tinker-create-sampling-session"),
    path("asample", views.asample, name="tinker-asample"),
    path("retrieve_future", views.retrieve_future, name="tinker-retrieve-future"),
    path("training_runs", views.training_runs, name="tinker-training-runs"),
    path("training_runs/<str:run_id>", views.training_run, name="tinker-training-run"),
    path("training_runs/<str:run_id>/checkpoints", views.run_checkpoints, name="tinker-run-checkpoints"),
    path("training_runs/<str:run_id>/checkpoints/<str:folder>/<str:name>/publish", views.publish_checkpoint,
         name="tinker-publish-checkpoint"),
    re_path(r"^(?P<rest>.*)$", views.unknown, name="tinker-unknown"),
]
