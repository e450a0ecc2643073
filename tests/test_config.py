import secrets
import subprocess
import sys

import pytest

from core.config import load_config
from core.env import ConfigError
from tests.processes import ROOT

STRONG_SECRET_KEY = secrets.token_hex(32)
# What a deployment sets: tests/environment.py puts the suite itself in development mode.
PRODUCTION = {
    "DEBUG": "false",
    "SECRET_KEY": STRONG_SECRET_KEY,
    "ALLOWED_HOSTS": "platform.example.com",
    "CSRF_TRUSTED_ORIGINS": "https://platform.example.com",
}


@pytest.fixture
def production(monkeypatch):
    for name, value in PRODUCTION.items():
        monkeypatch.setenv(name, value)


def test_it_defaults_to_sqlite_under_the_data_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.delenv("DYNAMIC_LORA_PATH", raising=False)
    monkeypatch.setenv("DATA_DIR", str(tmp_path))
    config = load_config()
    assert config.database["ENGINE"] == "django.db.backends.sqlite3"
    assert config.database["NAME"] == str(tmp_path / "platform.sqlite3")
    assert config.dynamic_lora_path == str(tmp_path / "adapters")


def test_it_reads_postgresql_from_database_url(monkeypatch):
    monkeypatch.setenv("DATABASE_URL", "postgres://alice:secret@db.internal:6543/platform")
    database = load_config().database
    assert (database["ENGINE"], database["HOST"], database["PORT"], database["NAME"]) == (
        "django.db.backends.postgresql", "db.internal", 6543, "platform",
    )


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("DEBUG", "maybe", "DEBUG='maybe' is not a boolean"),
        ("DATABASE_URL", "mysql://db/x", "DATABASE_URL='mysql://db/x' is not a usable URL"),
        ("DATABASE_URL", "postgres://u:p@host:port/db", "DATABASE_URL='postgres://u:p@host:port/db' cannot be parsed"),
        ("REDIS_URL", "localhost:6379", "REDIS_URL='localhost:6379' is not a usable URL"),
        ("WEB_PORT", "eighty", "WEB_PORT='eighty' is not a whole number"),
        ("JOB_TIME_LIMIT_SECONDS", "0", "JOB_TIME_LIMIT_SECONDS=0 is too small"),
        ("JOB_DATABASE_WAIT_SECONDS", "-1", "JOB_DATABASE_WAIT_SECONDS=-1 is too small"),
        ("MAX_COMPLETION_N", "0", "MAX_COMPLETION_N=0 is too small"),
        ("DYNAMIC_LORA_PATH", "s3://", "names no bucket"),
        ("DYNAMIC_LORA_PATH", "gs://bucket/x", "use a local folder or s3://bucket/prefix"),
    ],
)
def test_it_names_the_variable_of_a_bad_value(monkeypatch, variable, value, message):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError, match=message.replace("?", r"\?")):
        load_config()


def test_it_keeps_an_s3_dynamic_path(monkeypatch):
    monkeypatch.setenv("DYNAMIC_LORA_PATH", "s3://adapters/team-a/")
    assert load_config().dynamic_lora_path == "s3://adapters/team-a"


def test_it_refuses_the_development_secret_outside_debug(monkeypatch):
    monkeypatch.setenv("DEBUG", "false")
    monkeypatch.delenv("SECRET_KEY", raising=False)
    with pytest.raises(ConfigError, match="SECRET_KEY must be set"):
        load_config()


def test_it_is_in_production_mode_unless_debug_is_asked_for(production, monkeypatch):
    monkeypatch.delenv("DEBUG")
    config = load_config()
    assert not config.debug and config.hsts_seconds == 365 * 24 * 3600
    monkeypatch.setenv("DEBUG", "true")
    assert load_config().debug and load_config().hsts_seconds == 0  # development is plain http


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("SECRET_KEY", "short-but-set", "SECRET_KEY is too weak for DEBUG=false"),
        ("SECRET_KEY", "ab" * 40, "SECRET_KEY is too weak"),  # long, but two characters
        ("SECRET_KEY", "django-insecure-" + STRONG_SECRET_KEY, "SECRET_KEY is too weak"),
        ("ALLOWED_HOSTS", "*", "ALLOWED_HOSTS must list this server's host names when DEBUG is false"),
        ("ALLOWED_HOSTS", "platform.example.com,*", "ALLOWED_HOSTS must list"),
        ("ALLOWED_HOSTS", "", "ALLOWED_HOSTS must list"),
        ("CSRF_TRUSTED_ORIGINS", "http://platform.example.com", "must be an origin starting with https://"),
        ("CSRF_TRUSTED_ORIGINS", "platform.example.com", "CSRF_TRUSTED_ORIGINS: 'platform.example.com' must be"),
        ("HSTS_SECONDS", "-1", "HSTS_SECONDS=-1 is too small"),
    ],
)
def test_production_mode_refuses_unsafe_values(production, monkeypatch, variable, value, message):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError, match=message):
        load_config()


def test_it_keeps_secrets_out_of_the_configurations_repr(production, monkeypatch):
    secret = secrets.token_hex(20)
    for name in ("INTERNAL_TOKEN", "MONITORING_TOKEN", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(name, f"{name}-{secret}")
    monkeypatch.setenv("DATABASE_URL", f"postgres://platform:{secret}@db.internal:5432/platform")
    monkeypatch.setenv("REDIS_URL", f"redis://:{secret}@redis.internal:6379/0")
    text = repr(load_config())
    assert secret not in text and STRONG_SECRET_KEY not in text
    assert "allowed_hosts=['platform.example.com']" in text  # the rest is still there to read


def _start(command: list[str], **env: str) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(command, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"DATABASE_URL": "postgres://u:p@host:port/db"}, "configuration error: DATABASE_URL="),
        ({"DEBUG": "perhaps"}, "configuration error: DEBUG='perhaps' is not a boolean"),
        ({**PRODUCTION, "ALLOWED_HOSTS": "*"}, "configuration error: ALLOWED_HOSTS must list"),
        ({**PRODUCTION, "SECRET_KEY": "short-but-set"}, "configuration error: SECRET_KEY is too weak"),
    ],
)
def test_bad_configuration_stops_the_web_process_with_one_line(env, expected):
    result = _start([sys.executable, "manage.py", "check"], **env)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert result.stderr.startswith(expected)


def test_production_mode_passes_djangos_deployment_checks():
    result = _start([sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"], **PRODUCTION)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_model_without_weights_stops_the_pool_and_set_up_with_one_line(tmp_path):
    catalog = tmp_path / "models.toml"
    catalog.write_text('[[models]]\nid = "acme/missing-7b"\nweights = "/nowhere/missing-7b"\n')
    for command in ([sys.executable, "-m", "inference"], [sys.executable, "-m", "core.prepare_weights"]):
        result = _start(command, MODEL_CATALOG=str(catalog))
        assert result.returncode == 2
        assert result.stderr.strip() == "configuration error: model 'acme/missing-7b': no weights at /nowhere/missing-7b"


def test_it_derives_the_same_internal_token_from_the_same_secret_key(monkeypatch):
    monkeypatch.delenv("INTERNAL_TOKEN", raising=False)
    monkeypatch.setenv("SECRET_KEY", "one deployment's secret")
    first = load_config().internal_token
    assert load_config().internal_token == first  # web, pool and replicas start separately and agree
    assert len(first) == 64 and "secret" not in first
    monkeypatch.setenv("SECRET_KEY", "another deployment's secret")
    assert load_config().internal_token != first


def test_it_takes_internal_and_monitoring_tokens_from_the_environment(monkeypatch):
    monkeypatch.setenv("INTERNAL_TOKEN", "i" * 40)
    monkeypatch.delenv("MONITORING_TOKEN", raising=False)
    assert load_config().monitoring_token == load_config().internal_token == "i" * 40
    monkeypatch.setenv("MONITORING_TOKEN", "m" * 40)
    assert (load_config().internal_token, load_config().monitoring_token) == ("i" * 40, "m" * 40)


@pytest.mark.parametrize("value", ["short", "x" * 40 + " y", "x" * 40 + "\n"])
def test_it_refuses_a_short_or_header_breaking_internal_token(monkeypatch, value):
    monkeypatch.setenv("INTERNAL_TOKEN", value)
    with pytest.raises(ConfigError, match="INTERNAL_TOKEN must be at least 32 visible ASCII characters"):
        load_config()


def test_the_workers_beat_sweeps_as_often_as_sweep_seconds_says():
    read_schedule = "import workers; print(workers.app.conf.beat_schedule['sweep-jobs']['schedule'])"
    swept = _start([sys.executable, "-c", read_schedule], SWEEP_SECONDS="7")
    assert swept.returncode == 0, swept.stderr
    assert swept.stdout.split() == ["7.0"]
