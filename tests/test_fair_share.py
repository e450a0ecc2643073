# ruff: noqa: F811 (pytest fixtures are imported, then named as arguments)
"""An organization trains at most its cap of jobs at once: its next job waits, queued, while another
organization's job is claimed first, and is sent again once a slot frees. The domain functions are
called directly, as a trainer and the sweeper call them; nothing trains."""

from __future__ import annotations

from datetime import timedelta

import pytest

from finetuning import job_status, training_turns
from finetuning.models import FineTuningJob, JobStatus
from tests.fine_tuning_jobs import ONE_STEP, launch
from tests.inference_fixtures import BASE
from tests.limits import lower_limits
from workers.sweep import sweep

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def sent(not_queued, monkeypatch) -> list[str]:
    """The jobs sent to the trainers, recorded instead of sent."""
    recorded: list[str] = []
    monkeypatch.setattr("finetuning.training_turns.send_to_trainer", recorded.append)
    return recorded


def test_it_keeps_a_job_over_its_organizations_running_cap_waiting_and_claims_another_organizations_first(
    alice, charlie, sent, settings
):
    lower_limits(settings, running_jobs_per_organization=1)
    first, second = launch(alice, ONE_STEP, "first"), launch(alice, ONE_STEP, "second")
    others = launch(charlie, ONE_STEP, "others")
    sent.clear()

    assert training_turns.claim(first, "trainer-1") == 1
    assert training_turns.claim(second, "trainer-2") is None  # Acme already runs its one job
    waiting = FineTuningJob.objects.get(pk=second)
    assert waiting.status == JobStatus.QUEUED
    assert waiting.events.filter(message__contains="RUNNING_JOBS_PER_ORGANIZATION").count() == 1
    assert training_turns.claim(others, "trainer-2") == 1  # Globex's job goes ahead

    job_status.fail(first, 1, "test", "finished")  # its trainer then hands the slot on
    assert training_turns.send_waiting(alice.organization.pk) == [second] and sent == [second]
    assert training_turns.claim(second, "trainer-1") == 1


def test_with_one_trainer_another_organizations_job_starts_before_the_backlog_queued_ahead_of_it(alice, charlie, sent):
    backlog = [launch(alice, ONE_STEP, f"backlog-{i}") for i in range(4)]
    others = launch(charlie, ONE_STEP, "others")
    assert "1 job ahead" in FineTuningJob.objects.get(pk=others).events.values_list("message", flat=True).first()

    # One trainer takes the messages in the order they were sent, each job to its end.
    started = []
    while sent:
        claimed = training_turns.claim_next(sent.pop(0), "the-only-trainer")
        if claimed is not None:
            started.append(claimed.job_id)
            job_status.fail(claimed.job_id, claimed.attempt, "test", "finished")
    assert started == [backlog[0], others, *backlog[1:]]  # Globex waited for one job, not for four
    assert FineTuningJob.objects.filter(status=JobStatus.QUEUED).count() == 0  # no job was left without a message


def test_a_passed_over_job_is_sent_again_so_it_keeps_a_message(alice, charlie, sent):
    first, second = launch(alice, ONE_STEP, "first"), launch(alice, ONE_STEP, "second")
    others = launch(charlie, ONE_STEP, "others")
    assert training_turns.claim(first, "trainer-1") == 1
    sent.clear()

    claimed = training_turns.claim_next(second, "trainer-2")  # Acme started a job more recently than Globex
    assert claimed is not None and claimed.job_id == others
    assert sent == [second] and FineTuningJob.objects.get(pk=second).status == JobStatus.QUEUED
    assert training_turns.claim_next(others, "trainer-3") is None and sent == [second]  # a spent message wakes no one


def test_the_sweeper_sends_a_waiting_job_again_only_once_its_organization_has_a_free_slot(alice, sent, settings):
    lower_limits(settings, running_jobs_per_organization=1)
    first, second = launch(alice, ONE_STEP, "first"), launch(alice, ONE_STEP, "second")
    assert training_turns.claim(first, "trainer-1") == 1 and training_turns.claim(second, "trainer-2") is None
    sent.clear()

    assert sweep(lost_after=timedelta(0))["resent"] == [] and sent == []  # no slot: sending would only churn
    job_status.fail(first, 1, "test", "finished")  # and its trainer died before handing the slot on
    assert sweep(lost_after=timedelta(0))["resent"] == [second] and sent == [second]


def test_it_refuses_a_job_past_the_organizations_cap_of_queued_jobs(alice, not_queued, settings):
    lower_limits(settings, queued_jobs_per_organization=1)
    launch(alice, ONE_STEP, "first")
    file_id = FineTuningJob.objects.get(suffix="first").training_file
    refused = alice.api.post("/v1/fine_tuning/jobs", {"model": BASE, "training_file": file_id}, format="json")
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert error["code"] == "too_many_queued_jobs" and "QUEUED_JOBS_PER_ORGANIZATION" in error["message"]
    assert FineTuningJob.objects.for_org(alice.organization).count() == 1
