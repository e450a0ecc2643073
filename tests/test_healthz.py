import httpx
import pytest

from tests.inference_fixtures import internal_headers, monitoring_headers
from tests.processes import celery_worker_command, running, wait_until

pytestmark = pytest.mark.django_db

DEAD = "http://127.0.0.1:9"  # the discard port: nothing listens there


@pytest.mark.engine
def test_it_is_200_when_database_redis_worker_and_pool_are_up(client, celery_worker, inference_pool):
    response = client.get("/healthz", headers=monitoring_headers())
    body = response.json()
    assert response.status_code == 200, body
    assert body["status"] == "ok" and body["down"] == []
    assert set(body["checks"]) == {"database", "redis", "workers", "inference_pool"}
    assert "1 replica(s) ready" in body["checks"]["inference_pool"]["detail"]


def test_it_is_503_and_names_every_part_that_is_down(client, settings):
    settings.CELERY_BROKER_URL = "redis://127.0.0.1:9/0"
    settings.INFERENCE_POOL_URL = DEAD
    response = client.get("/healthz", headers=monitoring_headers())
    body = response.json()
    assert response.status_code == 503
    assert body["down"] == ["redis", "workers", "inference_pool"]
    assert body["checks"]["database"]["ok"]
    assert "127.0.0.1:9" in body["checks"]["inference_pool"]["detail"]


def test_it_reports_no_worker_when_none_listens_on_the_broker(client, settings):
    settings.CELERY_BROKER_URL = "redis://127.0.0.1:6379/9"  # a live Redis that no worker consumes
    settings.INFERENCE_POOL_URL = DEAD
    body = client.get("/healthz", headers=monitoring_headers()).json()
    assert body["checks"]["redis"]["ok"]
    assert body["checks"]["workers"] == {
        "ok": False, "detail": "no worker answered (start one: celery -A workers worker)",
    }


def test_it_tells_a_caller_without_the_monitoring_token_only_up_or_down(client, settings):
    settings.CELERY_BROKER_URL = "redis://127.0.0.1:9/0"
    settings.INFERENCE_POOL_URL = DEAD
    for headers in ({}, {"Authorization": "Bearer a-guess"}):
        response = client.get("/healthz", headers=headers)
        assert (response.status_code, response.json()) == (503, {"status": "unavailable"})  # no address, no host


def test_it_opens_the_detail_to_the_monitoring_token_not_to_the_internal_one_when_they_differ(client, settings):
    settings.INFERENCE_POOL_URL = DEAD
    settings.MONITORING_TOKEN = "m" * 40  # a scraper's own credential: it cannot call the pool
    assert "checks" not in client.get("/healthz", headers=internal_headers()).json()
    assert "inference_pool" in client.get("/healthz", headers=monitoring_headers()).json()["down"]


@pytest.mark.django_db(transaction=True)
def test_it_names_the_queue_that_no_worker_consumes(client, settings, test_database_url):
    broker = "redis://127.0.0.1:6379/8"  # a broker of its own, with one worker that reads only "default"
    settings.CELERY_BROKER_URL = broker
    settings.INFERENCE_POOL_URL = DEAD
    environment = {"REDIS_URL": broker, "DATABASE_URL": test_database_url}
    with running("default-only-worker", celery_worker_command(queues="default"), environment) as process:
        def workers_detail() -> str:
            return client.get("/healthz", headers=monitoring_headers()).json()["checks"]["workers"]["detail"]

        wait_until(lambda: "no worker answered" not in workers_detail(), 60, "worker", process)
        body = client.get("/healthz", headers=monitoring_headers()).json()
    assert "workers" in body["down"]
    assert "no worker consumes the queue(s) 'training'" in body["checks"]["workers"]["detail"]


@pytest.mark.engine
def test_the_prepared_base_model_answers_through_a_pool_replica(inference_pool):
    replica = httpx.get(f"{inference_pool}/health", headers=internal_headers()).json()["replicas"][0]
    response = httpx.post(
        f"{replica['url']}/v1/chat/completions",
        headers=internal_headers(),
        json={
            "model": replica["model"],
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 16,
            "temperature": 0,
        },
        timeout=60,
    )
    assert "Paris" in response.json()["choices"][0]["message"]["content"]
