"""The Tinker protocol's doors without an engine or a trainer: the SDK's protobuf bodies decoded
within bounds (hostile ones refused naming the problem, nothing queued), futures that belong to
their organization, sessions that end, and runs whose trainer died failed with their queued
requests. The SDK's own encoder makes the valid bodies."""

from __future__ import annotations

import json
from datetime import timedelta

import numpy as np
import pytest
import zstandard
from django.test import Client
from django.utils import timezone
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from core import tinker_wire
from tests.inference_fixtures import BASE
from training_loops import futures
from training_loops.lost_runs import fail_lost_runs
from training_loops.models import CheckpointKind, LoopCheckpoint, LoopRun, LoopSession, RunStatus

pytestmark = pytest.mark.django_db(transaction=True)


def proto_body(model_id: str, data: list[types.Datum], loss_fn: str = "cross_entropy") -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn), model_id=model_id, seq_id=1
    )
    return forward_backward_request_to_proto(request).SerializeToString()


def datum(tokens: list[int], **inputs) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


def test_the_sdks_forward_backward_body_decodes_to_its_tokens_and_inputs():
    body = proto_body("run", [datum([1, 2, 3], target_tokens=[2, 3, 4], weights=[0.0, 1.0, 1.0])], "importance_sampling")
    call = tinker_wire.forward_backward_call(body)
    assert call.model_id == "run" and call.loss_fn == "importance_sampling" and call.seq_id == 1
    (only,) = call.data
    assert only.tokens == [1, 2, 3] and only.inputs == {"target_tokens": [2, 3, 4], "weights": [0.0, 1.0, 1.0]}


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"\xff\xff\xff not a protobuf", "not a ForwardBackwardRequest"),
        (proto_body("run", [datum([1, 2], weights=np.array([np.nan, 1.0], dtype=np.float32))]), "NaN"),
        (proto_body("run", [datum([1, 2], weights=[1.0, 1.0, 1.0])]), "3 values for 2 tokens"),
        (proto_body("run", [datum([1] * 40_000), datum([1] * 40_000)]), "65,536 tokens"),
        (proto_body("run", [datum([1])] * 1025), "1025 items"),
    ],
    ids=["corrupt", "NaN", "length", "too many tokens", "too many data"],
)
def test_a_hostile_forward_backward_body_is_refused_naming_the_problem(body: bytes, says: str):
    with pytest.raises(tinker_wire.WireError, match=says):
        tinker_wire.forward_backward_call(body)


def test_a_zstd_body_inflates_within_a_bound_and_a_bomb_is_refused():
    body = proto_body("run", [datum([1, 2])])
    assert tinker_wire.inflated(zstandard.ZstdCompressor().compress(body), "zstd") == body
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (tinker_wire.MAX_INFLATED_BYTES + 1))
    with pytest.raises(tinker_wire.WireError, match="inflates past"):
        tinker_wire.inflated(bomb, "zstd")
    with pytest.raises(tinker_wire.WireError, match="corrupt"):
        tinker_wire.inflated(b"\x28\xb5\x2f\xfd broken", "zstd")


@pytest.fixture
def tinker_api(alice) -> Client:
    return Client(raise_request_exception=False, headers={"X-API-Key": f"tml-{alice.key}"})


def running_run(persona, number: int = 0) -> LoopRun:
    session = LoopSession.objects.create(organization=persona.organization)
    return LoopRun.objects.create(
        id=f"{session.pk}:train:{number}", session=session, organization=persona.organization, base_model=BASE,
        lora_rank=8, status=RunStatus.RUNNING, heartbeat_at=timezone.now(),
    )


def test_a_hostile_forward_backward_is_a_400_and_queues_nothing(tinker_api, alice):
    run = running_run(alice)
    bad = proto_body(run.pk, [datum([1, 2], weights=np.array([np.inf, 1.0], dtype=np.float32))])
    response = tinker_api.post("/api/v1/forward_backward", bad, content_type=tinker_wire.PROTOBUF)
    assert response.status_code == 400 and "infinity" in response.json()["error"]["message"]
    assert futures.sync_redis().llen(futures.ops_key(run.pk)) == 0


def test_a_platform_key_without_the_sdks_prefix_works_and_a_wrong_one_is_a_401(alice):
    plain = Client(headers={"X-API-Key": alice.key}).get("/api/v1/get_server_capabilities")
    assert plain.status_code == 200 and plain.json()["supported_models"][0]["model_name"] == BASE
    assert Client(headers={"X-API-Key": "tml-sk-wrong"}).get("/api/v1/get_server_capabilities").status_code == 401


def test_another_organizations_run_future_and_checkpoint_are_not_found(tinker_api, alice, charlie):
    theirs = running_run(charlie)
    LoopCheckpoint.objects.create(run=theirs, kind=CheckpointKind.SAMPLER, name="theirs", revision=1)
    queued = tinker_api.post("/api/v1/optim_step", {"model_id": theirs.pk, "adam_params": {}}, content_type="application/json")
    assert queued.status_code == 404 and queued.json()["error"]["code"] == "training_run_not_found", queued.content
    request_id = Client(headers={"X-API-Key": f"tml-{charlie.key}"}).post(
        "/api/v1/optim_step", {"model_id": theirs.pk, "adam_params": {}}, content_type="application/json"
    ).json()["request_id"]
    looked_up = tinker_api.post("/api/v1/retrieve_future", {"request_id": request_id}, content_type="application/json")
    assert looked_up.status_code == 404, looked_up.content
    sample = {"num_samples": 1, "prompt": {"chunks": [{"tokens": [1]}]}, "sampling_params": {},
              "model_path": f"tinker://{theirs.pk}/sampler_weights/theirs"}
    sampled = tinker_api.post("/api/v1/asample", sample, content_type="application/json")
    assert sampled.status_code == 404, sampled.content
    published = tinker_api.post(f"/api/v1/training_runs/{theirs.pk}/checkpoints/sampler_weights/theirs/publish", "", content_type="application/json")
    assert published.status_code == 404


def test_a_finished_sessions_runs_stop_and_say_how_to_go_on(tinker_api, alice, settings):
    run = running_run(alice)
    assert tinker_api.post(f"/api/v1/sessions/{run.session_id}/finish", {}, content_type="application/json").status_code == 200
    run.session.refresh_from_db()
    assert run.session.is_gone(timezone.now())
    LoopRun.objects.filter(pk=run.pk).update(status=RunStatus.STOPPED)
    refused = tinker_api.post("/api/v1/optim_step", {"model_id": run.pk, "adam_params": {}}, content_type="application/json")
    assert refused.status_code == 409 and "saved state" in refused.json()["error"]["message"]


def test_a_run_whose_trainer_died_fails_naming_its_last_state_and_its_queued_requests_fail_too(alice, settings):
    run = running_run(alice)
    LoopCheckpoint.objects.create(run=run, kind=CheckpointKind.STATE, name="step-3", storage_key="x/")
    LoopRun.objects.filter(pk=run.pk).update(heartbeat_at=timezone.now() - timedelta(seconds=settings.CONFIG.job_stale_after_s + 5))
    client = futures.sync_redis()
    client.rpush(futures.ops_key(run.pk), json.dumps({"request_id": "req_lost", "op": "optim_step"}))
    assert fail_lost_runs(timezone.now()) == [run.pk]
    run.refresh_from_db()
    assert run.status == RunStatus.FAILED and f"tinker://{run.pk}/weights/step-3" in run.error_message
    outcome = json.loads(client.get("loops:result:req_lost"))
    assert outcome["category"] == "server" and "failed" in outcome["error"]
    assert fail_lost_runs(timezone.now()) == []  # once


def test_a_rank_past_the_catalogs_limit_is_a_400_naming_it_and_makes_no_run(tinker_api, alice):
    session = LoopSession.objects.create(organization=alice.organization)
    body = {"session_id": session.pk, "base_model": BASE, "lora_config": {"rank": 32}, "model_seq_id": 0}
    refused = tinker_api.post("/api/v1/create_model", body, content_type="application/json")
    error = refused.json()["error"]
    assert refused.status_code == 400 and error["param"] == "lora_config.rank" and "from 1 to 16" in error["message"]
    assert not LoopRun.objects.exists()


def test_sessions_past_the_organizations_cap_are_a_429_until_one_closes_or_goes_silent(tinker_api, alice, monkeypatch):
    monkeypatch.setattr("training_loops.runs.MAX_LIVE_SESSIONS_PER_ORGANIZATION", 2)
    body = {"tags": [], "user_metadata": None, "sdk_version": "0.38.0"}

    def create():
        return tinker_api.post("/api/v1/create_session", body, content_type="application/json")

    first, _second = create().json()["session_id"], create()
    refused = create()
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "too_many_training_sessions", refused.content
    assert "ServiceClient.close" in refused.json()["error"]["message"]
    LoopSession.objects.filter(pk=first).update(heartbeat_at=timezone.now() - timedelta(minutes=5))  # its client went away
    assert create().status_code == 200
