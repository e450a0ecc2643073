"""Shared fixtures: real worker and inference-pool processes, started once per test session."""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import socket
import sys
from urllib.parse import quote

import pytest
from django.conf import settings as django_settings
from django.db import connection

from base.celery import app as celery_app
from tests.environment import LANE, LANES
from tests.inference_fixtures import internal_headers, pool_environment
from tests.processes import answers, celery_worker_command, running, running_web, wait_until

pytest_plugins = ["tests.personas", "tests.browser", "tests.resource_report"]
# The helpers test modules share, moved out of those test modules: their asserts keep pytest's
# messages (pytest rewrites the asserts of test modules and conftest only, and of modules named here
# before anything imports them).
pytest.register_assert_rewrite(
    "tests.adapter_archives", "tests.compositions", "tests.dead_pool", "tests.fake_pool", "tests.file_uploads",
    "tests.fine_tuning_jobs", "tests.helpers", "tests.lora_adapters", "tests.mix_pool", "tests.recording_pool",
    "tests.served_answers", "tests.webhook_receiver",
)

# Celery reads its settings once, lazily: read them now, before a test overrides Django settings.
_ = celery_app.conf.broker_url
# Passwords hashed at one iteration (tests/quick_passwords.py says why), in this process only.
django_settings.PASSWORD_HASHERS = ["tests.quick_passwords.OneIterationPBKDF2PasswordHasher"]


def _url_of(settings_dict: dict) -> str:
    """A DATABASE_URL for the test database, so worker processes open the same one."""
    if connection.vendor == "sqlite":
        return f"sqlite:///{settings_dict['NAME']}"
    user = quote(settings_dict.get("USER") or "")
    password = f":{quote(settings_dict['PASSWORD'])}" if settings_dict.get("PASSWORD") else ""
    port = f":{settings_dict['PORT']}" if settings_dict.get("PORT") else ""
    return f"postgres://{user}{password}@{settings_dict.get('HOST') or 'localhost'}{port}/{settings_dict['NAME']}"


@pytest.fixture(scope="session")
def django_db_modify_db_settings() -> None:
    """A lane's own test database (tests/environment.py): the quick lane's is test_test_quick while
    the slow lane's is test_test, so the two pytest processes of one test command never share rows."""
    from django.conf import settings

    if LANE is LANES["slow"]:
        return
    for database in settings.DATABASES.values():
        test_name = database.get("TEST", {}).get("NAME") or f"test_{database['NAME']}"
        database.setdefault("TEST", {})["NAME"] = f"{test_name}_{LANE.name}"


@pytest.fixture(scope="session", autouse=True)
def _database_left_free(django_db_setup, django_db_blocker):
    """End the test database's other sessions before it is dropped: the gateway's ORM calls run in
    asgiref's shared threads, which keep their connections (by design) until the process exits."""
    yield
    if connection.vendor != "postgresql":
        return
    with django_db_blocker.unblock(), connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )


@pytest.fixture(scope="session")
def test_database_url(django_db_setup) -> str:
    return _url_of(connection.settings_dict)


class Worker:
    """A real Celery worker process on the test broker and database; tests may kill and restart it."""

    def __init__(self, database_url: str, queues: str = "default,training", name: str = "worker", concurrency: int = 1):
        self.env = {"DATABASE_URL": database_url}
        self.name = name
        self.command = celery_worker_command(queues, f"test-{name}", concurrency=concurrency)
        self.hostname = self.command[self.command.index("--hostname") + 1].replace("%h", socket.gethostname())
        self.process = None
        self._running = None

    @property
    def alive(self) -> bool:
        return self._running is not None

    def start(self) -> None:
        self._running = running(self.name, self.command, self.env)
        self.process = self._running.__enter__()
        alive = lambda: bool(celery_app.control.ping(destination=[self.hostname], timeout=0.5, limit=1))  # noqa: E731
        wait_until(alive, 60, f"celery {self.name}", self.process)

    def stop(self) -> None:
        if self._running is not None:
            self._running.__exit__(None, None, None)
            self._running = None

    def kill(self) -> None:
        """Die as a crashed machine would: SIGKILL, no chance to finish or acknowledge anything."""
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.stop()


@pytest.fixture(scope="session")
def _session_worker(test_database_url):
    celery_app.control.purge()  # a task left by an aborted earlier run must not run now
    worker = Worker(test_database_url)
    yield worker
    worker.stop()


@pytest.fixture
def celery_worker(_session_worker):
    """The session's worker, started on first use (and again after a scenario stopped it). Tests
    that hand it work must commit their rows: mark them django_db(transaction=True)."""
    if not _session_worker.alive:
        _session_worker.start()
    return _session_worker


@pytest.fixture(scope="session")
def _loop_trainer(test_database_url):
    """A trainer for training runs driven step by step (the ``loops`` queue), two at once as bin/run's
    ``looper``; a run stops (freeing its model) 20 s after its last request."""
    trainer = Worker(test_database_url, "loops", "looper", concurrency=2)
    trainer.env |= {"LOOP_IDLE_SECONDS": "20"}
    yield trainer
    trainer.stop()


@pytest.fixture
def loop_trainer(_loop_trainer):
    if not _loop_trainer.alive:
        _loop_trainer.start()
    return _loop_trainer


class SharedPool:
    """The session's one inference pool (one vLLM replica of the test catalog's base model),
    started on first use. A scenario that starts engines of its own stops it first
    (``machine_to_itself``): two engines, a trainer and the test process alive at once do not fit
    the machine, and a suite that passes by how full memory happens to be is not a test."""

    def __init__(self) -> None:
        self._running = None

    def ensure(self) -> str:
        from django.conf import settings

        if self._running is None:
            self._running = running("pool", [sys.executable, "-m", "inference"], pool_environment())
            process = self._running.__enter__()
            health = f"{settings.INFERENCE_POOL_URL}/health"
            wait_until(lambda: answers(health, headers=internal_headers()), 300, "inference pool", process)
        return settings.INFERENCE_POOL_URL

    def stop(self) -> None:
        if self._running is not None:
            self._running.__exit__(None, None, None)
            self._running = None


@pytest.fixture(scope="session")
def _shared_pool():
    pool = SharedPool()
    yield pool
    pool.stop()


@pytest.fixture
def inference_pool(_shared_pool) -> str:
    """The session's pool, running: its URL."""
    return _shared_pool.ensure()


@pytest.fixture(scope="session")
def _gateway_web(test_database_url) -> str:
    """The web process for the inference tests (``inference_fixtures.gateway``): it starts without the pool."""
    with running_web("gateway", {"DATABASE_URL": test_database_url, **pool_environment()}) as url:
        yield url


def _give_memory_back() -> None:
    """The test process's models from finished tests go back to the machine, not only to malloc's
    free lists: a test file that loads the base model in-process costs the rest of the run nothing."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


@pytest.fixture(scope="module", autouse=True)
def _memory_given_back_after_each_file():
    yield
    _give_memory_back()


@pytest.fixture(scope="session")
def machine_to_itself(_shared_pool, _session_worker) -> None:
    """For scenarios that start engines (or Ray clusters) of their own: the session's pool and
    worker are stopped first. These scenarios run last (``pytest_collection_modifyitems``), so
    nothing starts the shared ones again behind them."""
    _shared_pool.stop()
    _session_worker.stop()
    _give_memory_back()


# What differs between PostgreSQL and SQLite, by test file: bin/test runs the whole suite on
# PostgreSQL, then these again on SQLite (bin/run's default database; its product tests run on
# SQLite already). The marker is ``databases``.
DIFFERS_BY_DATABASE = {
    "test_job_fencing.py": "claims and fenced state changes: conditional updates under concurrent writers",
    "test_job_dispatch.py": "whose turn: ordered claims of queued jobs",
    "test_fair_share.py": "fair turns across organizations: aggregates and ordering",
    "test_jobs_api.py": "pagination after an id, JSON hyperparameters",
    "test_files_api.py": "pagination, the row written with the stored bytes",
    "test_usage.py": "usage summed by day and model: date truncation and aggregates",
    "test_upload_quotas.py": "storage sums under the organization's lock",
    "test_accounts.py": "unique names and memberships",
    "test_roles.py": "owners and members under the organization's lock",
    "test_model_revisions.py": "revision numbers and rollbacks: conditional updates",
    "test_worker.py": "the worker's report names the database",
}
# Of those files' tests that train, these files' run again on SQLite: what they train through is the
# database itself. The others train on SQLite in the product tests already (bin/run's default).
TRAINS_THROUGH_THE_DATABASE = {"test_job_fencing.py"}


def pytest_collection_modifyitems(items: list) -> None:
    """The running product's tests first: bin/run starts an engine of its own, and it must not share
    the machine with the session's engine, which starts lazily with the first test that needs it.
    Scenarios with engines of their own last, once the session's pool is no longer needed."""

    def turn(item) -> int:
        if item.get_closest_marker("product") is not None:
            return 0
        return 2 if "machine_to_itself" in item.fixturenames else 1

    items.sort(key=turn)  # stable: a module's tests keep their order, so its fixtures start once
    for item in items:
        trains = item.get_closest_marker("training") is not None
        if item.path.name in DIFFERS_BY_DATABASE and (not trains or item.path.name in TRAINS_THROUGH_THE_DATABASE):
            item.add_marker("databases")


@pytest.fixture
def not_queued(monkeypatch):
    """For tests that run or recover a job themselves: it is never queued, so the session's worker
    (alive if an earlier test started it) cannot take it first."""
    monkeypatch.setattr("finetuning.training_turns.send_to_trainer", lambda job_id: None)
