"""Revisions and checkpoints on the real engine, through the gateway, as a user meets them: a stream
that began on r1 ends on r1 while r2 is published; a rollback answers on the next request; a
checkpoint answers while its job still trains."""

from __future__ import annotations

import threading
import uuid

import httpx
import pytest

from finetuning.job_creation import JobRequest, create_job
from finetuning.models import FineTuningJob
from tests.fine_tuning_jobs import _publish_revision
from tests.inference_fixtures import *  # noqa: F403
from tests.inference_fixtures import BASE, adapter_store, publish_fine_tuned_model
from tests.personas import good_dataset

pytestmark = [pytest.mark.engine, pytest.mark.django_db(transaction=True)]

QUESTION = [{"role": "user", "content": "Tell me about the history of Paris."}]


def _ask(persona, model: str) -> tuple[str, str]:
    """The greedy answer, and the name of the model that answered."""
    answer = persona.client.chat.completions.create(model=model, messages=QUESTION, max_tokens=24, temperature=0)
    return answer.choices[0].message.content, answer.model


def test_a_stream_that_began_on_r1_ends_on_r1_while_r2_is_published_and_the_next_request_gets_r2(alice, make_adapter):
    name = publish_fine_tuned_model(alice, f"rev-{uuid.uuid4().hex[:8]}", make_adapter(seed=71))
    r1_answer, answered_by = _ask(alice, name)
    assert answered_by == f"{name}@r1"
    stream = alice.client.chat.completions.create(
        model=name, messages=QUESTION, max_tokens=24, temperature=0, stream=True
    )
    chunks = [next(stream)]  # streaming on r1
    _publish_revision(name, make_adapter(seed=72), 2)
    r2_answer, answered_by = _ask(alice, name)  # answered while the stream is still open
    chunks += list(stream)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert streamed == r1_answer and {chunk.model for chunk in chunks} == {f"{name}@r1"}
    assert answered_by == f"{name}@r2" and r2_answer != r1_answer
    # Each revision is its own adapter to the engine, so neither reads the other's cached prefix:
    # r1 pinned still answers as r1 after r2 served the same prompt, and the other way round.
    assert _ask(alice, f"{name}@r1") == (r1_answer, f"{name}@r1")
    assert _ask(alice, name) == (r2_answer, f"{name}@r2")


def test_a_rollback_through_the_api_takes_effect_on_the_next_request(alice, make_adapter, gateway):
    name = publish_fine_tuned_model(alice, f"rollback-{uuid.uuid4().hex[:8]}", make_adapter(seed=73))
    r1_answer, _ = _ask(alice, name)
    _publish_revision(name, make_adapter(seed=74), 2)
    assert _ask(alice, name)[1] == f"{name}@r2"

    headers = {"Authorization": f"Bearer {alice.api_key}"}
    rolled = httpx.post(f"{gateway}/v1/fine_tuning/models/{name}/rollback", json={"revision": 1}, headers=headers)
    assert rolled.status_code == 200 and rolled.json()["revision"] == 1, rolled.text
    assert _ask(alice, name) == (r1_answer, f"{name}@r1")  # the very next request
    listed = httpx.get(f"{gateway}/v1/fine_tuning/models/{name}/revisions", headers=headers).json()
    assert [(r["revision"], r["current"]) for r in listed["data"]] == [(2, False), (1, True)]


@pytest.mark.training
def test_a_checkpoint_answers_while_its_job_still_trains(alice, monkeypatch, not_queued):
    from workers import run_job as run_job_module

    saved, release = threading.Event(), threading.Event()
    on_checkpoint = run_job_module.JobCallbacks.on_checkpoint

    def pause_after_the_first(self, epoch, step, adapter_dir, metrics):
        on_checkpoint(self, epoch, step, adapter_dir, metrics)
        if epoch == 1:
            saved.set()
            release.wait(300)  # the job stays "running", its heartbeat beating, until the test has asked

    monkeypatch.setattr(run_job_module.JobCallbacks, "on_checkpoint", pause_after_the_first)
    training = alice.client.files.create(file=("train.jsonl", good_dataset(12)), purpose="fine-tune")
    suffix = f"ckpt-{uuid.uuid4().hex[:8]}"
    request = JobRequest(model=BASE, training_file=training.id, suffix=suffix, hyperparameters={"n_epochs": 2, "batch_size": 12})
    job = create_job(alice.organization, None, request)
    outcome: list[str] = []
    trainer = threading.Thread(target=lambda: outcome.append(run_job_module.run_job(job.id, worker="in-test")))
    trainer.start()
    try:
        assert saved.wait(300), "the first checkpoint was not saved"
        checkpoints = alice.client.fine_tuning.jobs.checkpoints.list(job.id).data
        checkpoint = checkpoints[0].fine_tuned_model_checkpoint
        assert checkpoint == f"{BASE}:{suffix}:ckpt-step-1"
        answer = alice.client.chat.completions.create(model=checkpoint, messages=QUESTION, max_tokens=8, temperature=0)
        assert answer.model == checkpoint and answer.choices[0].message.content
        assert alice.client.fine_tuning.jobs.retrieve(job.id).status == "running"
    finally:
        release.set()
        trainer.join(300)
    assert outcome == ["succeeded"]
    assert FineTuningJob.objects.get(pk=job.id).checkpoints.count() == 2
    # Deleting the model takes its checkpoints with it.
    assert alice.client.models.delete(f"{BASE}:{suffix}").deleted
    assert adapter_store().version(checkpoint) is None
