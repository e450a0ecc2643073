"""The platform's configuration: every environment variable is read here, once.

Django settings, the Celery workers and the inference pool all build on ``load_config()``, so each
variable has one name, one default and one parser. ``.env.example`` lists them all.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import dj_database_url

from core.env import ConfigError, env_bool, env_int, env_list, env_path, env_str, env_token, env_url
from core.internal_token import derive_internal_token

REPO_ROOT = Path(__file__).resolve().parent.parent

# Only for local development; a deployment sets SECRET_KEY (checked in load_config).
_DEV_SECRET_KEY = "dev-only-insecure-secret-key-change-me"


@dataclass(frozen=True)
class S3Settings:
    endpoint_url: str | None  # None: AWS itself; set for MinIO, moto and other S3-compatible stores
    access_key_id: str | None
    secret_access_key: str | None
    region: str


@dataclass(frozen=True)
class Limits:
    """What one tenant may use, so it cannot exhaust the service for the others (README: Limits).
    Each field's message to a refused caller names its variable, from ``LIMIT_SETTINGS``."""

    completions_per_minute_per_key: int
    completions_per_minute_per_organization: int
    uploads_per_hour_per_organization: int
    storage_bytes_per_organization: int
    running_jobs_per_organization: int  # more wait, queued, while other organizations' jobs start
    queued_jobs_per_organization: int  # creating one more is refused (429)
    sign_in_failures: int  # per username and per client address, within sign_in_window_s
    sign_in_window_s: int


# The variable behind each limit: error messages name it, so an operator knows what to raise.
LIMIT_SETTINGS = {
    "completions_per_minute_per_key": "COMPLETIONS_PER_MINUTE_PER_KEY",
    "completions_per_minute_per_organization": "COMPLETIONS_PER_MINUTE_PER_ORGANIZATION",
    "uploads_per_hour_per_organization": "UPLOADS_PER_HOUR_PER_ORGANIZATION",
    "storage_bytes_per_organization": "STORAGE_MB_PER_ORGANIZATION",
    "running_jobs_per_organization": "RUNNING_JOBS_PER_ORGANIZATION",
    "queued_jobs_per_organization": "QUEUED_JOBS_PER_ORGANIZATION",
    "sign_in_failures": "SIGN_IN_FAILURES",
    "sign_in_window_s": "SIGN_IN_WINDOW_SECONDS",
}


def _limits() -> Limits:
    def setting(field: str, default: int) -> int:
        return env_int(LIMIT_SETTINGS[field], default, minimum=1)

    return Limits(
        completions_per_minute_per_key=setting("completions_per_minute_per_key", 600),
        completions_per_minute_per_organization=setting("completions_per_minute_per_organization", 1200),
        uploads_per_hour_per_organization=setting("uploads_per_hour_per_organization", 60),
        storage_bytes_per_organization=setting("storage_bytes_per_organization", 10 * 1024) * 1024 * 1024,  # MB
        running_jobs_per_organization=setting("running_jobs_per_organization", 2),
        queued_jobs_per_organization=setting("queued_jobs_per_organization", 100),
        sign_in_failures=setting("sign_in_failures", 10),
        sign_in_window_s=setting("sign_in_window_s", 15 * 60),
    )


@dataclass(frozen=True)
class Config:
    debug: bool
    secret_key: str
    allowed_hosts: list[str]
    data_dir: Path
    database: dict
    redis_url: str
    model_catalog: Path
    dynamic_lora_path: str  # a local folder or s3://bucket/prefix
    files_path: str  # uploaded datasets and checkpoints: a local folder or s3://bucket/prefix
    max_upload_bytes: int
    min_training_examples: int
    s3: S3Settings
    inference_pool_url: str
    # What the web, the pool and the vLLM replicas present to each other (core.internal_token):
    # INTERNAL_TOKEN, or derived from SECRET_KEY so separately started processes agree on it.
    internal_token: str
    monitoring_token: str  # opens /metrics and the detail of /healthz; the internal token unless set
    first_replica_port: int  # local vLLM replicas listen on consecutive ports from here
    web_port: int
    job_heartbeat_s: int  # how often a running job says its worker is alive
    job_stale_after_s: int  # a running job silent this long has lost its worker: it is queued again
    job_database_wait_s: int  # how long a trainer's database call waits out an unreachable database
    job_time_limit_s: int  # a job still training after this long fails (a hung trainer frees its queue)
    limits: Limits


def _database(data_dir: Path) -> dict:
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
        if not raw[len("s3://"):].split("/", 1)[0]:
            raise ConfigError(f"{name}={raw!r} names no bucket: use s3://bucket/prefix")
        return raw.rstrip("/")
    if "://" in raw:
        raise ConfigError(f"{name}={raw!r}: use a local folder or s3://bucket/prefix")
    return str(Path(raw).expanduser().resolve())


def _job_liveness() -> tuple[int, int]:
    heartbeat = env_int("JOB_HEARTBEAT_SECONDS", 10, minimum=1)
    stale_after = env_int("JOB_STALE_AFTER_SECONDS", 180, minimum=1)
    if stale_after < 3 * heartbeat:  # a late heartbeat or two must not cost a live job its worker
        raise ConfigError(f"JOB_STALE_AFTER_SECONDS={stale_after} must be at least 3 x JOB_HEARTBEAT_SECONDS ({3 * heartbeat})")
    return heartbeat, stale_after


def load_config() -> Config:
    debug = env_bool("DEBUG", True)
    secret_key = env_str("SECRET_KEY", _DEV_SECRET_KEY)
    if not debug and secret_key == _DEV_SECRET_KEY:
        raise ConfigError("SECRET_KEY must be set when DEBUG is false")
    data_dir = env_path("DATA_DIR", REPO_ROOT / "data")
    job_heartbeat_s, job_stale_after_s = _job_liveness()
    internal_token = env_token("INTERNAL_TOKEN") or derive_internal_token(secret_key)
    return Config(
        debug=debug,
        secret_key=secret_key,
        allowed_hosts=env_list("ALLOWED_HOSTS", "localhost,127.0.0.1,[::1],testserver"),
        data_dir=data_dir,
        database=_database(data_dir),
        redis_url=env_url("REDIS_URL", "redis://127.0.0.1:6379/0", schemes=("redis", "rediss")),
        model_catalog=env_path("MODEL_CATALOG", REPO_ROOT / "models.toml"),
        dynamic_lora_path=_storage_location("DYNAMIC_LORA_PATH", data_dir / "adapters"),
        files_path=_storage_location("FILES_PATH", data_dir / "files"),
        max_upload_bytes=env_int("MAX_UPLOAD_MB", 100, minimum=1) * 1024 * 1024,
        min_training_examples=env_int("MIN_TRAINING_EXAMPLES", 10, minimum=1),
        s3=S3Settings(
            endpoint_url=env_str("S3_ENDPOINT_URL", "") or None,
            access_key_id=env_str("AWS_ACCESS_KEY_ID", "") or None,
            secret_access_key=env_str("AWS_SECRET_ACCESS_KEY", "") or None,
            region=env_str("AWS_DEFAULT_REGION", "us-east-1"),
        ),
        inference_pool_url=env_url("INFERENCE_POOL_URL", "http://127.0.0.1:8100", schemes=("http", "https")),
        internal_token=internal_token,
        monitoring_token=env_token("MONITORING_TOKEN") or internal_token,
        first_replica_port=env_int("FIRST_REPLICA_PORT", 8200, minimum=1),
        web_port=env_int("WEB_PORT", 8000, minimum=1),
        job_heartbeat_s=job_heartbeat_s,
        job_stale_after_s=job_stale_after_s,
        job_database_wait_s=env_int("JOB_DATABASE_WAIT_SECONDS", 120, minimum=0),
        job_time_limit_s=env_int("JOB_TIME_LIMIT_SECONDS", 6 * 3600, minimum=1),
        limits=_limits(),
    )


def shell_exports() -> str:
    """The values the shell scripts need, as ``export`` lines, so bash never repeats a default."""
    config = load_config()
    redis = urlsplit(config.redis_url)
    values = {
        "WEB_PORT": config.web_port,
        "REDIS_PORT": redis.port or 6379,
        "REDIS_IS_LOCAL": int(redis.hostname in ("127.0.0.1", "localhost", "::1")),
        "DATA_DIR": config.data_dir,
    }
    return "\n".join(f"export {name}={shlex.quote(str(value))}" for name, value in values.items())


if __name__ == "__main__":
    try:
        print(shell_exports())
    except ConfigError as exc:
        raise SystemExit(f"configuration error: {exc}") from None
