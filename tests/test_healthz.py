import httpx
import pytest

from tests.processes import celery_worker_command, running, wait_until

pytestmark = pytest.mark.django_db

DEAD = "http://127.0.0.1:9"  # the discard port: nothing listens there


@pytest.mark.engine
def test_it_is_200_when_database_redis_worker_and_pool_are_up(client, celery_worker, inference_pool):
    response = client.get("/healthz")
    body = response.json()
    assert response.status_code == 200, body
    assert body["status"] == "ok" and body["down"] == []
    assert set(body["checks"]) == {"database", "redis", "workers", "inference_pool"}
    assert "1 replica(s) ready" in body["checks"]["inference_pool"]["detail"]


def test_it_is_503_and_names_every_part_that_is_down(client, settings):
    settings.CELERY_BROKER_URL = "redis://127.0.0.1:9/0"
    settings.INFERENCE_POOL_URL = DEAD
    response = client.get("/healthz")
    body = response.json()
    assert response.status_code == 503
    assert body["down"] == ["redis", "workers", "inference_pool"]
    assert body["checks"]["database"]["ok"]
    assert "127.0.0.1:9" in body["checks"]["inference_pool"]["detail"]


def test_it_reports_no_worker_when_none_listens_on_the_broker(client, settings):
    settings.CELERY_BROKER_URL = "redis://127.0.0.1:6379/14"  # a live Redis that no worker consumes
    settings.INFERENCE_POOL_URL = DEAD
    body = client.get("/healthz").json()
    assert body["checks"]["redis"]["ok"]
    assert body["checks"]["workers"] == {
        "ok": False, "detail": "no worker answered (start one: celery -A workers worker)",
    }  # fmt: skip


@pytest.mark.django_db(transaction=True)
def test_it_names_the_queue_that_no_worker_consumes(client, settings, test_database_url):
    broker = "redis://127.0.0.1:6379/12"  # a broker of its own, with one worker that reads only "default"
    settings.CELERY_BROKER_URL = broker
    settings.INFERENCE_POOL_URL = DEAD
    environment = {"REDIS_URL": broker, "DATABASE_URL": test_database_url}
    with running("default-only-worker", celery_worker_command(queues="default"), environment) as process:
        def workers_detail() -> str:
            return client.get("/healthz").json()["checks"]["workers"]["detail"]

        wait_until(lambda: "no worker answered" not in workers_detail(), 60, "worker", process)
        body = client.get("/healthz").json()
    assert "workers" in body["down"]
    assert "no worker consumes the queue(s) 'training'" in body["checks"]["workers"]["detail"]


@pytest.mark.engine
def test_the_prepared_base_model_answers_through_a_pool_replica(inference_pool):
    replica = httpx.get(f"{inference_pool}/health").json()["replicas"][0]
    response = httpx.post(
        f"{replica['url']}/v1/chat/completions",
        json={
            "model": replica["model"],
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 16,
            "temperature": 0,
        },
        timeout=60,
    )
    assert "Paris" in response.json()["choices"][0]["message"]["content"]
