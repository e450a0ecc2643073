"""The official openai client works against the platform unchanged: base_url and api_key only."""

import time

import openai
import pytest

from tests.personas import good_dataset

pytestmark = [pytest.mark.training, pytest.mark.django_db(transaction=True)]

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"


def client_for(persona, live_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=persona.key, max_retries=0)


def test_the_openai_client_uploads_trains_and_reads_a_job(alice, charlie, live_server, celery_worker):
    client = client_for(alice, live_server)
    uploaded = client.files.create(file=("train.jsonl", good_dataset(12)), purpose="fine-tune")
    assert uploaded.id.startswith("file-") and uploaded.bytes == len(good_dataset(12))
    assert client.files.retrieve(uploaded.id).filename == "train.jsonl"

    job = client.fine_tuning.jobs.create(
        model=BASE, training_file=uploaded.id, suffix="client", hyperparameters={"n_epochs": 1, "batch_size": 12}
    )
    assert job.status == "queued" and job.suffix == "client"
    assert [j.id for j in client.fine_tuning.jobs.list(limit=5).data] == [job.id]

    deadline = time.monotonic() + 240
    while (job := client.fine_tuning.jobs.retrieve(job.id)).status not in ("succeeded", "failed", "cancelled"):
        assert time.monotonic() < deadline, job
        time.sleep(1)
    assert job.status == "succeeded", job.error
    assert job.fine_tuned_model == f"{BASE}:client" and job.trained_tokens > 0 and job.finished_at >= job.created_at

    events = client.fine_tuning.jobs.list_events(job.id, limit=50).data
    # Newest first: whether the pool loaded the model already (when one runs), then the job's end.
    assert events[0].message.startswith(f"Ready on 1 replica(s): {BASE}:client") or (
        f"{BASE}:client loads on its first request" in events[0].message
    )
    assert events[1].message == "The job has successfully completed"
    assert any(event.type == "metrics" and event.data["step"] == 1 for event in events)
    checkpoints = client.fine_tuning.jobs.checkpoints.list(job.id).data
    assert [c.step_number for c in checkpoints] == [1] and checkpoints[0].fine_tuning_job_id == job.id

    outsider = client_for(charlie, live_server)
    with pytest.raises(openai.NotFoundError):
        outsider.fine_tuning.jobs.retrieve(job.id)
    with pytest.raises(openai.NotFoundError):
        outsider.files.content(uploaded.id)


def test_the_openai_client_sees_errors_with_their_param(alice, live_server):
    client = client_for(alice, live_server)
    with pytest.raises(openai.BadRequestError) as error:
        client.files.create(file=("bad.jsonl", b'{"messages": []}\n' * 12), purpose="fine-tune")
    assert "line 1: messages must be a non-empty list" in error.value.message
    assert error.value.body["param"] == "file"

    uploaded = client.files.create(file=("train.jsonl", good_dataset(12)), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError) as error:
        client.fine_tuning.jobs.create(model="gpt-4o-mini", training_file=uploaded.id)
    assert error.value.body["param"] == "model"

    job = client.fine_tuning.jobs.create(model=BASE, training_file=uploaded.id)
    assert client.fine_tuning.jobs.cancel(job.id).status == "cancelled"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{live_server.url}/v1", api_key="sk-wrong", max_retries=0).files.list()
    assert client.files.delete(uploaded.id).deleted
