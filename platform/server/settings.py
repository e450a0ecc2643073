"""Django settings: a thin mapping of ``core.config`` (where every variable is parsed) onto Django."""

from core.config import REPO_ROOT, load_config

CONFIG = load_config()
MODEL_CATALOG = CONFIG.catalog()

DEBUG = CONFIG.debug
SECRET_KEY = CONFIG.secret_key
ALLOWED_HOSTS = CONFIG.allowed_hosts
CSRF_TRUSTED_ORIGINS = CONFIG.csrf_trusted_origins
DATA_DIR = CONFIG.data_dir

# Production (DEBUG=false) is HTTPS only; development runs on plain http://127.0.0.1. Behind a
# TLS-terminating proxy the web process (uvicorn) takes the scheme from the proxy's X-Forwarded-Proto
# (uvicorn trusts it from 127.0.0.1 by default), so these see the request as the browser made it.
SECURE_SSL_REDIRECT = not DEBUG
SECURE_REDIRECT_EXEMPT = [r"^healthz$"]  # a load balancer's plain-http probe; it shows nothing private
SESSION_COOKIE_SECURE = not DEBUG
CSRF_COOKIE_SECURE = not DEBUG
SECURE_HSTS_SECONDS = CONFIG.hsts_seconds
SECURE_HSTS_INCLUDE_SUBDOMAINS = True
# Preloading (security.W021) puts the domain in browsers' built-in HTTPS list for good: a decision
# for the domain's owner at hstspreload.org, not a default of this application.
SILENCED_SYSTEM_CHECKS = ["security.W021"]
# Debug pages hide settings named like secrets (TOKEN, KEY, SECRET, ...); ours also hides URLs and
# backends, which may embed a password (CELERY_BROKER_URL, CELERY_RESULT_BACKEND).
DEFAULT_EXCEPTION_REPORTER_FILTER = "base.error_responses.SecretsHidingFilter"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "accounts",
    "finetuning",
    "evals",
    "batches",
    "training_loops",
    "health",
    "gateway",
    "usage",
    "webhooks",
    "dashboard",
]

LOGIN_URL = "dashboard:login"
LOGIN_REDIRECT_URL = "dashboard:jobs"
LOGOUT_REDIRECT_URL = "dashboard:login"

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "server.middleware.RefuseNulInAddress",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # A view's exception: a database outage answers 503, anything else under /v1/ a JSON 500.
    "server.middleware.ViewExceptionMiddleware",
]

ROOT_URLCONF = "server.urls"
ASGI_APPLICATION = "server.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [REPO_ROOT / "frontend_templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DATABASES = {"default": CONFIG.database}
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    # Tests run the worker in another process, so the test database must be a file it can open.
    DATABASES["default"]["TEST"] = {"NAME": str(DATA_DIR / "test.sqlite3")}
    # Several processes (web, workers) write: wait for the lock instead of failing at once.
    DATABASES["default"].setdefault("OPTIONS", {})["timeout"] = 20
    DATABASES["default"]["CONN_HEALTH_CHECKS"] = False
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = DATA_DIR / "static"  # for a deployment that collects static files behind a CDN
# WhiteNoise serves the apps' static folders directly (read once at start-up): every web process
# has its CSS and JS without a collect step, the test servers included.
WHITENOISE_USE_FINDERS = True

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["accounts.authentication.BearerKeyAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "base.error_responses.exception_handler",
    "DEFAULT_PARSER_CLASSES": ["server.json_parser.StrictJSONParser", "rest_framework.parsers.MultiPartParser"],
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Fine-tune and serve API",
    "DESCRIPTION": "OpenAI-compatible files, fine-tuning jobs and chat completions.",
    "VERSION": "1",
    "REDOC_DIST": "SIDECAR",
    "SERVE_INCLUDE_SCHEMA": False,
    "POSTPROCESSING_HOOKS": ["drf_spectacular.hooks.postprocess_schema_enums", "gateway.openapi.add_inference_endpoints"],
}

# Celery (the app is base/celery.py): JSON only, so a task never unpickles data from the broker.
CELERY_BROKER_URL = CONFIG.redis_url
CELERY_RESULT_BACKEND = CONFIG.redis_url
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_IMPORTS = ["workers.tasks"]  # what a worker registers; senders use names (base.celery.send)
CELERY_TASK_DEFAULT_QUEUE = "default"
# A task is acknowledged only when it finishes, so a worker that dies mid-task leaves it queued.
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# A web request that enqueues must not hang on a broker that is down: a few quick tries, then a 503
# (the job stays queued in the database and the sweeper sends it again).
CELERY_TASK_PUBLISH_RETRY_POLICY = {"max_retries": 2, "interval_start": 0, "interval_step": 0.5, "interval_max": 1}
CELERY_BROKER_TRANSPORT_OPTIONS = {"socket_connect_timeout": 2, "socket_timeout": 5}

INFERENCE_POOL_URL = CONFIG.inference_pool_url
RAY_SERVE_URL = CONFIG.ray_serve_url  # for the catalog's models with backend = "ray" (base.serving_client)
INTERNAL_TOKEN = CONFIG.internal_token  # sent to the pool with every call (base.serving_client)
MONITORING_TOKEN = CONFIG.monitoring_token  # opens /metrics and the detail of /healthz
# Webhooks may reach private and loopback addresses over http:// too (webhooks.targets); a setting of
# its own so a test can turn it off and on.
WEBHOOKS_ALLOW_PRIVATE_ADDRESSES = CONFIG.webhooks_allow_private_addresses

# Bodies are capped by server.body_limits before Django reads them. Django's own caps must not
# refuse what those allow (it would answer a bare 400), and under WSGI or the test client they are
# the only ones. An uploaded file larger than FILE_UPLOAD_MAX_MEMORY_SIZE (Django's default, said
# here) goes to a temporary file on disk, not memory; under ASGI Django spools the raw body the same way.
DATA_UPLOAD_MAX_MEMORY_SIZE = max(CONFIG.request_limits.completion_body_bytes.value, CONFIG.request_limits.request_body_bytes.value)
FILE_UPLOAD_MAX_MEMORY_SIZE = 2_621_440

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": "INFO"},
}
