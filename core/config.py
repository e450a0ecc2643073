"""The platform's configuration: every environment variable is read here, once.

Django settings, the Celery workers and the inference pool all build on ``load_config()``, so each
variable has one name, one default and one parser. ``.env.example`` lists them all.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import dj_database_url

from core.catalog import Catalog, load_catalog
from core.env import ConfigError, env_bool, env_int, env_list, env_path, env_str, env_token, env_url
from core.internal_token import derive_internal_token

REPO_ROOT = Path(__file__).resolve().parent.parent

# Only for local development; a deployment sets SECRET_KEY (checked in _secret_key).
_DEV_SECRET_KEY = "dev-only-insecure-secret-key-change-me"
# Django's own bar for a secret key (its deployment check, security.W009), so production mode
# passes `manage.py check --deploy`.
_MIN_SECRET_KEY_CHARS = 50
_MIN_SECRET_KEY_DISTINCT_CHARS = 5
_INSECURE_SECRET_KEY_PREFIX = "django-insecure-"
_HSTS_ONE_YEAR_S = 365 * 24 * 3600


# In both dataclasses, fields with repr=False hold secrets, or a URL or dict that may embed a password:
# a Config printed in a log line, a shell or an error page must not show them.
@dataclass(frozen=True)
class S3Settings:
    endpoint_url: str | None  # None: AWS itself; set for MinIO, moto and other S3-compatible stores
    access_key_id: str | None
    secret_access_key: str | None = field(repr=False)
    region: str


@dataclass(frozen=True)
class Limit:
    value: int
    setting: str  # the environment variable that sets it: every refusal names it, so it can be raised


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask of the web process, checked before any work is done for it (the
    body's size in ``server.body_limits``, a completion's fields in ``core.request_limits``)."""

    completion_body_bytes: Limit  # the body of POST /v1/chat/completions and /v1/completions
    request_body_bytes: Limit  # the body of any other request, uploads excepted (MAX_UPLOAD_MB)
    completion_n: Limit  # n: choices generated for one request
    completion_tokens: Limit  # max_tokens, max_completion_tokens and min_tokens
    logprobs: Limit  # logprobs (completions), top_logprobs (chat) and prompt_logprobs
    messages: Limit  # messages in one chat request
    prompt_chars: Limit  # characters of prompt or message text, a tokenizer-free bound on the prompt
    # models in one request's 'adapters' (each is a registry read; max_lora_rank bounds their sum anyway)
    mix_adapters: Limit


def _limit(name: str, default: int) -> Limit:
    return Limit(env_int(name, default, minimum=1), name)


def _request_limits() -> RequestLimits:
    return RequestLimits(
        completion_body_bytes=_limit("MAX_COMPLETION_BODY_BYTES", 1024 * 1024),
        request_body_bytes=_limit("MAX_REQUEST_BODY_BYTES", 1024 * 1024),
        completion_n=_limit("MAX_COMPLETION_N", 8),
        completion_tokens=_limit("MAX_COMPLETION_TOKENS", 4096),
        logprobs=_limit("MAX_LOGPROBS", 20),
        messages=_limit("MAX_MESSAGES", 256),
        prompt_chars=_limit("MAX_PROMPT_CHARS", 256 * 1024),
        mix_adapters=_limit("MAX_MIX_ADAPTERS", 8),
    )


UPLOAD_LIMIT_SETTING = "MAX_UPLOAD_MB"
ADAPTER_UPLOAD_LIMIT_SETTING = "MAX_ADAPTER_UPLOAD_MB"

WEBHOOKS_PRIVATE_SETTING = "WEBHOOKS_ALLOW_PRIVATE_ADDRESSES"

LORA_KERNELS_SETTING = "LORA_KERNELS"
FINESERVE_KERNELS, STOCK_KERNELS = "fineserve", "stock"


def lora_kernels() -> str:
    """Which LoRA kernels a CPU replica runs: ours (``inference.engine``) or vLLM's own. The
    replica process reads it too (a remote one has only its own environment)."""
    raw = env_str(LORA_KERNELS_SETTING, FINESERVE_KERNELS)
    if raw not in (FINESERVE_KERNELS, STOCK_KERNELS):
        raise ConfigError(f"{LORA_KERNELS_SETTING}={raw!r} is not one of: {FINESERVE_KERNELS}, {STOCK_KERNELS}")
    return raw


@dataclass(frozen=True)
class TenantLimits:
    """What one tenant may use, so it cannot exhaust the service for the others (docs/limits.md: Per tenant).
    Each field's message to a refused caller names its variable, from ``LIMIT_SETTINGS``."""

    completions_per_minute_per_key: int
    completions_per_minute_per_organization: int
    tokens_per_minute_per_key: int  # each request's prompt and the most it may generate, estimated up front
    tokens_per_minute_per_organization: int
    uploads_per_hour_per_organization: int
    storage_bytes_per_organization: int
    running_jobs_per_organization: int  # more wait, queued, while other organizations' jobs start
    queued_jobs_per_organization: int  # creating one more is refused (429)
    # Compositions that run on a worker (every method but linear), queued or running at once;
    # creating one more is refused (429) until one has finished.
    compositions_at_once_per_organization: int
    compositions_per_hour_per_organization: int  # every composition, linear too (each publishes a model)
    # Prompt tokens (estimated at upload) of an organization's unfinished batches: a batch that would
    # take it past this is refused (429) until some have finished. Batches pace themselves and yield
    # to live requests, so they are held to this, as OpenAI's are, rather than to the per-minute rates.
    batch_queue_tokens_per_organization: int
    sign_in_failures: int  # per username and per client address, within sign_in_window_s
    sign_in_window_s: int


# The variable behind each limit: error messages name it, so an operator knows what to raise.
LIMIT_SETTINGS = {
    "completions_per_minute_per_key": "COMPLETIONS_PER_MINUTE_PER_KEY",
    "completions_per_minute_per_organization": "COMPLETIONS_PER_MINUTE_PER_ORGANIZATION",
    "tokens_per_minute_per_key": "TOKENS_PER_MINUTE_PER_KEY",
    "tokens_per_minute_per_organization": "TOKENS_PER_MINUTE_PER_ORGANIZATION",
    "uploads_per_hour_per_organization": "UPLOADS_PER_HOUR_PER_ORGANIZATION",
    "storage_bytes_per_organization": "STORAGE_MB_PER_ORGANIZATION",
    "running_jobs_per_organization": "RUNNING_JOBS_PER_ORGANIZATION",
    "queued_jobs_per_organization": "QUEUED_JOBS_PER_ORGANIZATION",
    "compositions_at_once_per_organization": "COMPOSITIONS_AT_ONCE_PER_ORGANIZATION",
    "compositions_per_hour_per_organization": "COMPOSITIONS_PER_HOUR_PER_ORGANIZATION",
    "batch_queue_tokens_per_organization": "BATCH_QUEUE_TOKENS_PER_ORGANIZATION",
    "sign_in_failures": "SIGN_IN_FAILURES",
    "sign_in_window_s": "SIGN_IN_WINDOW_SECONDS",
}


def _limits() -> TenantLimits:
    def setting(field: str, default: int) -> int:
        return env_int(LIMIT_SETTINGS[field], default, minimum=1)

    return TenantLimits(
        completions_per_minute_per_key=setting("completions_per_minute_per_key", 600),
        completions_per_minute_per_organization=setting("completions_per_minute_per_organization", 1200),
        tokens_per_minute_per_key=setting("tokens_per_minute_per_key", 200_000),
        tokens_per_minute_per_organization=setting("tokens_per_minute_per_organization", 400_000),
        uploads_per_hour_per_organization=setting("uploads_per_hour_per_organization", 60),
        storage_bytes_per_organization=setting("storage_bytes_per_organization", 10 * 1024) * 1024 * 1024,  # MB
        running_jobs_per_organization=setting("running_jobs_per_organization", 2),
        queued_jobs_per_organization=setting("queued_jobs_per_organization", 100),
        compositions_at_once_per_organization=setting("compositions_at_once_per_organization", 2),
        compositions_per_hour_per_organization=setting("compositions_per_hour_per_organization", 20),
        batch_queue_tokens_per_organization=setting("batch_queue_tokens_per_organization", 20_000_000),
        sign_in_failures=setting("sign_in_failures", 10),
        sign_in_window_s=setting("sign_in_window_s", 15 * 60),
    )


@dataclass(frozen=True)
class Config:
    debug: bool  # development mode; false (production) unless DEBUG asks for it
    secret_key: str = field(repr=False)
    allowed_hosts: list[str]
    csrf_trusted_origins: list[str]  # origins (scheme://host) allowed to POST forms from another host
    hsts_seconds: int  # Strict-Transport-Security max-age in production; 0 in development
    data_dir: Path
    database: dj_database_url.DBConfig = field(repr=False)
    redis_url: str = field(repr=False)
    model_catalog: Path
    dynamic_lora_path: str  # a local folder or s3://bucket/prefix
    files_path: str  # uploaded datasets and checkpoints: a local folder or s3://bucket/prefix
    max_upload_bytes: int  # in bytes; UPLOAD_LIMIT_SETTING gives it in MiB
    # An uploaded adapter's archive, and its files once unpacked; ADAPTER_UPLOAD_LIMIT_SETTING in MiB.
    max_adapter_upload_bytes: int
    request_limits: RequestLimits
    min_training_examples: int
    s3: S3Settings
    inference_pool_url: str
    ray_serve_url: str  # the Ray Serve application's ingress, for catalog models with backend = "ray"
    # What the web, the pool and the vLLM replicas present to each other (core.internal_token):
    # INTERNAL_TOKEN, or derived from SECRET_KEY so separately started processes agree on it.
    internal_token: str = field(repr=False)
    # Opens /metrics and the detail of /healthz; the internal token unless set.
    monitoring_token: str = field(repr=False)
    first_replica_port: int  # local vLLM replicas listen on consecutive ports from here
    web_port: int
    job_heartbeat_s: int  # how often a running job says its worker is alive
    job_stale_after_s: int  # a running job silent this long has lost its worker: it is queued again
    job_database_wait_s: int  # how long a trainer's database call waits out an unreachable database
    job_time_limit_s: int  # a job still training after this long fails (a hung trainer frees its queue)
    sweep_s: int  # how often the worker's beat sweeps: stale jobs queued again, lost messages sent again
    loop_idle_s: int  # a training run (Tinker protocol) with no request for this long stops, freeing its trainer
    # A queued job or composition whose message the broker has not held for this long is sent again.
    lost_message_s: int
    # A job that ended without publishing (failed, cancelled) keeps its servable checkpoints this long.
    unpublished_checkpoints_days: int
    limits: TenantLimits  # what one organization may use
    lora_kernels: str  # FINESERVE_KERNELS or STOCK_KERNELS, for the CPU replicas
    # Webhooks may target private and loopback addresses and plain http:// (on-premises receivers);
    # otherwise only https:// at public addresses (core.public_addresses).
    webhooks_allow_private_addresses: bool

    def catalog(self) -> Catalog:
        """The model catalog MODEL_CATALOG names, read now."""
        return load_catalog(self.model_catalog, self.data_dir, self.dynamic_lora_path)


def _database(data_dir: Path) -> dj_database_url.DBConfig:
    default = f"sqlite:///{data_dir / 'platform.sqlite3'}"
    url = env_url("DATABASE_URL", default, schemes=("sqlite", "postgres", "postgresql"))
    try:
        return dj_database_url.parse(url, conn_max_age=60, conn_health_checks=True)
    except ValueError as exc:
        raise ConfigError(f"DATABASE_URL={url!r} cannot be parsed: {exc}") from None


def _storage_location(name: str, default: Path) -> str:
    """A local folder (made absolute) or ``s3://bucket/prefix``."""
    raw = env_str(name, str(default))
    if raw.startswith("s3://"):
        if not raw[len("s3://") :].split("/", 1)[0]:
            raise ConfigError(f"{name}={raw!r} names no bucket: use s3://bucket/prefix")
        return raw.rstrip("/")
    if "://" in raw:
        raise ConfigError(f"{name}={raw!r}: use a local folder or s3://bucket/prefix")
    return str(Path(raw).expanduser().resolve())


def _job_liveness() -> tuple[int, int]:
    heartbeat = env_int("JOB_HEARTBEAT_SECONDS", 10, minimum=1)
    stale_after = env_int("JOB_STALE_AFTER_SECONDS", 180, minimum=1)
    if stale_after < 3 * heartbeat:  # a late heartbeat or two must not cost a live job its worker
        raise ConfigError(
            f"JOB_STALE_AFTER_SECONDS={stale_after} must be at least 3 x JOB_HEARTBEAT_SECONDS ({3 * heartbeat})"
        )
    return heartbeat, stale_after


def _secret_key(debug: bool) -> str:
    """Everything signed (sessions, CSRF tokens, the derived internal token) is only as safe as this."""
    secret_key = env_str("SECRET_KEY", _DEV_SECRET_KEY)
    if debug:
        return secret_key
    if secret_key == _DEV_SECRET_KEY:
        raise ConfigError("SECRET_KEY must be set when DEBUG is false (for example: openssl rand -hex 32)")
    if (
        len(secret_key) < _MIN_SECRET_KEY_CHARS
        or len(set(secret_key)) < _MIN_SECRET_KEY_DISTINCT_CHARS
        or secret_key.startswith(_INSECURE_SECRET_KEY_PREFIX)
    ):
        raise ConfigError(
            f"SECRET_KEY is too weak for DEBUG=false: use at least {_MIN_SECRET_KEY_CHARS} random characters "
            "(for example: openssl rand -hex 32)"
        )
    return secret_key


def _allowed_hosts(debug: bool) -> list[str]:
    """The host names the web answers to; '*' would let a forged Host header into links and redirects."""
    hosts = env_list("ALLOWED_HOSTS", "localhost,127.0.0.1,[::1],testserver")
    if not debug and (not hosts or "*" in hosts):
        raise ConfigError("ALLOWED_HOSTS must list this server's host names when DEBUG is false (not '*', not empty)")
    return hosts


def _csrf_trusted_origins(debug: bool) -> list[str]:
    origins = env_list("CSRF_TRUSTED_ORIGINS", "")
    schemes = ("http://", "https://") if debug else ("https://",)  # production cookies travel over HTTPS only
    for origin in origins:
        if not origin.startswith(schemes) or not origin.split("://", 1)[1]:
            raise ConfigError(
                f"CSRF_TRUSTED_ORIGINS: {origin!r} must be an origin starting with {' or '.join(schemes)} "
                "(for example: https://platform.example.com)"
            )
    return origins


def configured_data_dir() -> Path:
    """Where the platform keeps what it makes (database, files, adapters, built kernels) by default.
    Read on its own too, by a replica process that has only its environment."""
    return env_path("DATA_DIR", REPO_ROOT / "data")


def load_config() -> Config:
    debug = env_bool("DEBUG", False)
    secret_key = _secret_key(debug)
    data_dir = configured_data_dir()
    job_heartbeat_s, job_stale_after_s = _job_liveness()
    internal_token = env_token("INTERNAL_TOKEN") or derive_internal_token(secret_key)
    hsts_seconds = env_int("HSTS_SECONDS", _HSTS_ONE_YEAR_S, minimum=0)
    return Config(
        debug=debug,
        secret_key=secret_key,
        allowed_hosts=_allowed_hosts(debug),
        csrf_trusted_origins=_csrf_trusted_origins(debug),
        hsts_seconds=0 if debug else hsts_seconds,  # development runs on plain http://localhost
        data_dir=data_dir,
        database=_database(data_dir),
        redis_url=env_url("REDIS_URL", "redis://127.0.0.1:6379/0", schemes=("redis", "rediss")),
        model_catalog=env_path("MODEL_CATALOG", REPO_ROOT / "models.toml"),
        dynamic_lora_path=_storage_location("DYNAMIC_LORA_PATH", data_dir / "adapters"),
        files_path=_storage_location("FILES_PATH", data_dir / "files"),
        max_upload_bytes=env_int(UPLOAD_LIMIT_SETTING, 100, minimum=1) * 1024 * 1024,
        max_adapter_upload_bytes=env_int(ADAPTER_UPLOAD_LIMIT_SETTING, 200, minimum=1) * 1024 * 1024,
        request_limits=_request_limits(),
        min_training_examples=env_int("MIN_TRAINING_EXAMPLES", 10, minimum=1),
        s3=S3Settings(
            endpoint_url=env_str("S3_ENDPOINT_URL", "") or None,
            access_key_id=env_str("AWS_ACCESS_KEY_ID", "") or None,
            secret_access_key=env_str("AWS_SECRET_ACCESS_KEY", "") or None,
            region=env_str("AWS_DEFAULT_REGION", "us-east-1"),
        ),
        inference_pool_url=env_url("INFERENCE_POOL_URL", "http://127.0.0.1:8100", schemes=("http", "https")),
        ray_serve_url=env_url("RAY_SERVE_URL", "http://127.0.0.1:8400", schemes=("http", "https")),
        internal_token=internal_token,
        monitoring_token=env_token("MONITORING_TOKEN") or internal_token,
        first_replica_port=env_int("FIRST_REPLICA_PORT", 8200, minimum=1),
        web_port=env_int("WEB_PORT", 8000, minimum=1),
        job_heartbeat_s=job_heartbeat_s,
        job_stale_after_s=job_stale_after_s,
        job_database_wait_s=env_int("JOB_DATABASE_WAIT_SECONDS", 120, minimum=0),
        job_time_limit_s=env_int("JOB_TIME_LIMIT_SECONDS", 6 * 3600, minimum=1),
        sweep_s=env_int("SWEEP_SECONDS", 30, minimum=1),
        loop_idle_s=env_int("LOOP_IDLE_SECONDS", 600, minimum=5),
        lost_message_s=env_int("LOST_MESSAGE_SECONDS", 60, minimum=1),
        unpublished_checkpoints_days=env_int("UNPUBLISHED_CHECKPOINTS_DAYS", 7, minimum=0),
        limits=_limits(),
        lora_kernels=lora_kernels(),
        webhooks_allow_private_addresses=env_bool(WEBHOOKS_PRIVATE_SETTING, False),
    )


def shell_exports() -> str:
    """The values the shell scripts need, as ``export`` lines, so bash never repeats a default."""
    config = load_config()
    redis = urlsplit(config.redis_url)
    catalog = config.catalog()
    values = {
        "WEB_PORT": config.web_port,
        "REDIS_PORT": redis.port or 6379,
        "REDIS_IS_LOCAL": int(redis.hostname in ("127.0.0.1", "localhost", "::1")),
        "DATA_DIR": config.data_dir,
        "DEV_MODE": int(config.debug),  # bin/run bootstraps the demo user only then
        "USES_RAY": int(bool(catalog.served_by("ray").models)),  # bin/run then starts Ray Serve too
    }
    return "\n".join(f"export {name}={shlex.quote(str(value))}" for name, value in values.items())


if __name__ == "__main__":
    try:
        print(shell_exports())
    except ConfigError as exc:
        raise SystemExit(f"configuration error: {exc}") from None
