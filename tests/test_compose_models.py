# ruff: noqa: F811 (pytest fixtures are imported, then named as arguments)
"""Composed models through the API: a weighted combination of an organization's fine-tuned models,
published under its own suffix with its lineage; refusals say what to fix and write nothing.
``linear`` is built in the request; ``svd``, ``ties`` and ``dare_linear`` on a worker (202, then a
composition to poll), capped per organization, measured against the storage quota first."""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path

import httpx
import numpy as np
import pytest
from django.utils import timezone

from core.adapter_store import CONFIG_FILE, WEIGHTS_FILE
from core.lora_algebra import read_tensors
from finetuning import models as finetuning_models
from finetuning.models import FineTunedModel
from finetuning.quotas import stored_bytes
from tests.compositions import SUFFIXES, parents  # noqa: F401 (parents: a fixture)
from tests.helpers import web_without_broker  # noqa: F401 (a fixture)
from tests.inference_fixtures import BASE, adapter_store, make_adapter  # noqa: F401
from tests.inference_fixtures import publish_fine_tuned_model as published
from tests.limits import lower_limits, own_counters  # noqa: F401 (a fixture)

pytestmark = pytest.mark.django_db(transaction=True)

COMPOSE = "/v1/fine_tuning/models"
COMPOSITIONS = "/v1/fine_tuning/compositions"


@pytest.fixture(autouse=True)
def _fresh_store():
    """The dynamic path outlives the test database: no adapter of an earlier run under our names."""
    for suffix in SUFFIXES:
        adapter_store().delete(f"{BASE}:{suffix}")


def compose(persona, **body):
    return persona.api.post(COMPOSE, body, format="json")


@pytest.fixture
def sent(monkeypatch) -> list[str]:
    """The compositions sent to the workers, and none sent: they stay queued for the test to run."""
    ids: list[str] = []
    monkeypatch.setattr("finetuning.compositions.send_to_worker", ids.append)
    return ids


def finished(persona, composition_id: str, timeout_s: float = 300) -> dict:
    """The composition as the API answers it, once the worker has finished it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        composition = persona.api.get(f"{COMPOSITIONS}/{composition_id}").json()
        if composition["status"] in ("succeeded", "failed"):
            return composition
        time.sleep(0.5)
    raise AssertionError(f"composition {composition_id} still {composition['status']} after {timeout_s} s")


def queued(response) -> dict:
    """A composition that runs on a worker: 202 at once, queued, with where to poll it."""
    assert response.status_code == 202, response.json()
    body = response.json()
    assert body["object"] == "fine_tuning.composition" and body["status"] == "queued" and body["fine_tuned_model"] is None
    assert response["Location"] == f"{COMPOSITIONS}/{body['id']}"
    return body


def _delta(folder: Path, module: str) -> np.ndarray:
    config = json.loads((folder / CONFIG_FILE).read_text())
    tensors = read_tensors(folder / WEIGHTS_FILE)
    a, b = tensors[f"{module}.lora_A.weight"].astype(np.float64), tensors[f"{module}.lora_B.weight"]
    return config["lora_alpha"] / config["r"] * b @ a


def test_a_linear_composition_is_published_with_its_lineage_and_equals_the_weighted_sum(alice, parents, tmp_path):
    left, right, _ = parents
    before = stored_bytes(alice.organization)
    response = compose(alice, parents=[{"model": left, "scale": 0.5}, {"model": right, "scale": 0.5}], suffix="blend")
    assert response.status_code == 200, response.json()
    name = f"{BASE}:blend"
    lineage = {
        "origin": "composed", "parents": [{"model": left, "scale": 0.5}, {"model": right, "scale": 0.5}],
        "method": "linear", "rank": 16, "approximation_error": 0.0,
    }
    assert response.json() | {"created": 0} == {
        "id": name, "object": "model", "created": 0, "owned_by": alice.organization.slug, "parent": BASE, "lineage": lineage,
        "revision": 1,
    }
    listed = {model["id"]: model for model in alice.api.get("/v1/models").json()["data"]}
    assert listed[name]["lineage"] == lineage and listed[left]["lineage"]["origin"] == "trained"

    stored = adapter_store().fetch(name, tmp_path / "cache")
    config = json.loads((stored / CONFIG_FILE).read_text())
    assert config["r"] == 16 and config["base_model_name_or_path"] == BASE
    module = "base_model.model.model.layers.3.self_attn.q_proj"
    expected = 0.5 * _delta(parents[left], module) + 0.5 * _delta(parents[right], module)
    np.testing.assert_allclose(_delta(stored, module), expected, atol=1e-5)
    assert stored_bytes(alice.organization) > before  # it is kept for the organization, like an upload
    assert alice.api.get(f"/v1/fine_tuning/models/{name}/adapter").status_code == 200


def test_an_exact_sum_over_the_served_rank_is_refused_naming_the_limit_and_svd_approximates_it(alice, parents):
    three = [{"model": name, "scale": 1.0} for name in parents]
    refused = compose(alice, parents=three, suffix="approx")
    error = refused.json()["error"]
    assert refused.status_code == 400 and error["code"] == "composition_rank_too_large", error
    assert "rank 24" in error["message"] and "max_lora_rank 16" in error["message"] and "svd" in error["message"]
    assert not FineTunedModel.objects.filter(suffix="approx").exists()

    composition = queued(compose(alice, parents=three, suffix="approx", method="svd", rank=12))
    assert composition["rank"] == 12 and composition["model"] == f"{BASE}:approx"
    run_composition(composition["id"], "test")  # what the worker runs
    done = alice.api.get(f"{COMPOSITIONS}/{composition['id']}").json()
    lineage = FineTunedModel.objects.get(name=f"{BASE}:approx").lineage
    assert lineage["method"] == "svd" and lineage["rank"] == 12
    assert 0 < lineage["approximation_error"] < 1  # rank 12 of a rank-24 sum: something is lost, not all
    assert done["status"] == "succeeded" and done["approximation_error"] == lineage["approximation_error"]


@pytest.mark.parametrize("method", ["ties", "dare_linear"])
def test_ties_and_dare_answer_202_queued_at_once_and_the_worker_publishes_them_at_the_served_rank(
    alice, parents, method, celery_worker
):
    left, right, _ = parents
    suffix = {"ties": "tied", "dare_linear": "dared"}[method]
    name = f"{BASE}:{suffix}"
    body = {"parents": [{"model": left, "scale": 1.0}, {"model": right, "scale": 0.7}], "method": method, "density": 0.3}
    started = time.monotonic()
    composition = queued(compose(alice, **body, suffix=suffix))
    answered_s = time.monotonic() - started
    assert answered_s < 5, answered_s  # the merge is not the request's: it reads two configs, not the weights
    assert composition["model"] == name and composition["rank"] == 16 and composition["density"] == 0.3
    listed = alice.api.get(COMPOSITIONS).json()
    assert [item["id"] for item in listed["data"]] == [composition["id"]]

    done = finished(alice, composition["id"])
    assert done["status"] == "succeeded" and done["error"] is None, done
    assert done["fine_tuned_model"] == name and done["finished_at"] >= done["created_at"]
    model = FineTunedModel.objects.get(name=name)
    lineage = model.lineage
    assert lineage["rank"] == 16 and lineage["density"] == 0.3 and lineage["approximation_error"] > 0
    # What the quota was asked for before the merge: at least what it took, and not much more.
    assert model.uploaded_bytes <= done["estimated_bytes"] < 1.01 * model.uploaded_bytes
    assert ("seed" in lineage) == (method == "dare_linear")
    assert done["approximation_error"] == lineage["approximation_error"]
    assert adapter_store().version(name) is not None  # published: served on its first request
    assert name in {model["id"] for model in alice.api.get("/v1/models").json()["data"]}


def test_a_composition_delivered_twice_publishes_once(alice, parents, sent, celery_worker):
    from workers.tasks import compose_model

    left, right, _ = parents
    body = {"parents": [{"model": left, "scale": 1.0}, {"model": right, "scale": 1.0}], "method": "ties"}
    composition = queued(compose(alice, **body, suffix="twice"))
    assert sent == [composition["id"]]
    first, second = compose_model.delay(composition["id"]), compose_model.delay(composition["id"])  # a redelivery
    outcomes = sorted([first.get(timeout=300), second.get(timeout=300)])
    assert outcomes[1] == "succeeded" and outcomes[0].startswith(f"nothing claimed for {composition['id']}"), outcomes
    model = FineTunedModel.objects.get(name=f"{BASE}:twice")
    assert model.revisions.count() == 1 and model.revision == 1
    assert alice.api.get(f"{COMPOSITIONS}/{composition['id']}").json()["status"] == "succeeded"


def test_a_composition_whose_parent_is_deleted_before_it_runs_fails_saying_so_and_publishes_nothing(alice, parents, sent):
    left, right, _ = parents
    body = {"parents": [{"model": left, "scale": 1.0}, {"model": right, "scale": 1.0}], "method": "svd", "rank": 8}
    composition = queued(compose(alice, **body, suffix="orphan"))
    assert compose(alice, parents=body["parents"], suffix="orphan").json()["error"]["code"] == "suffix_taken"  # held
    assert alice.api.delete(f"/v1/models/{right}").status_code == 200
    assert run_composition(composition["id"], "test") == "failed"

    failed = alice.api.get(f"{COMPOSITIONS}/{composition['id']}").json()
    assert failed["status"] == "failed" and failed["error"]["code"] == "model_not_found", failed
    assert right in failed["error"]["message"] and "Nothing was published" in failed["error"]["message"]
    assert not FineTunedModel.objects.filter(name=f"{BASE}:orphan").exists()
    assert adapter_store().version(f"{BASE}:orphan") is None
    assert run_composition(composition["id"], "test").startswith("nothing claimed")  # a late redelivery
    assert compose(alice, parents=body["parents"][:1], suffix="orphan").status_code == 200  # the suffix is free again


def test_a_composition_past_the_storage_quota_is_refused_before_any_merge_and_queues_nothing(
    alice, parents, settings, sent, monkeypatch
):
    def merge(*args, **kwargs):
        raise AssertionError("the merge ran for a composition over the quota")

    monkeypatch.setattr("finetuning.compose.merge", merge)
    lower_limits(settings, storage_bytes_per_organization=stored_bytes(alice.organization) + 5 * 1024 * 1024)
    left, right, _ = parents
    for method in ("linear", "ties"):  # rank 16 on every layer of the base model: about 19.5 MB
        body = {"parents": [{"model": left, "scale": 1.0}, {"model": right, "scale": 1.0}], "method": method}
        refused = compose(alice, **body, suffix="refused")
        error = refused.json()["error"]
        assert refused.status_code == 403 and error["code"] == "storage_quota_exceeded", (method, error)
        assert "STORAGE_MB_PER_ORGANIZATION" in error["message"] and "composed model" in error["message"]
    assert sent == [] and not finetuning_models.Composition.objects.exists()
    assert not FineTunedModel.objects.filter(suffix="refused").exists()


def test_the_storage_quota_counts_the_compositions_under_way_at_their_most(alice, parents, settings, sent):
    lower_limits(settings, storage_bytes_per_organization=stored_bytes(alice.organization) + 30 * 1024 * 1024)
    left, right, _ = parents
    body = {"parents": [{"model": left, "scale": 1.0}, {"model": right, "scale": 1.0}], "method": "ties"}
    first = queued(compose(alice, **body, suffix="capped-1"))  # at most about 19.5 MB
    refused = compose(alice, **body, suffix="capped-2")  # two of them cannot both fit in 30 MB
    error = refused.json()["error"]
    assert refused.status_code == 403 and error["code"] == "storage_quota_exceeded", error
    assert "under way" in error["message"] and error["param"] == "parents"
    assert sent == [first["id"]]
    assert run_composition(first["id"], "test") == "succeeded"  # it took what it was promised, and no more
    assert stored_bytes(alice.organization) <= first["estimated_bytes"] + 30 * 1024 * 1024


def test_a_composition_whose_quota_was_taken_before_it_ran_fails_and_publishes_nothing(alice, parents, settings, sent):
    left, right, _ = parents
    body = {"parents": [{"model": left, "scale": 1.0}, {"model": right, "scale": 1.0}], "method": "ties"}
    composition = queued(compose(alice, **body, suffix="squeezed"))
    lower_limits(settings, storage_bytes_per_organization=stored_bytes(alice.organization) + 1024 * 1024)  # meanwhile
    assert run_composition(composition["id"], "test") == "failed"
    failed = alice.api.get(f"{COMPOSITIONS}/{composition['id']}").json()
    assert failed["error"]["code"] == "storage_quota_exceeded" and "Nothing was published" in failed["error"]["message"]
    assert not FineTunedModel.objects.filter(suffix="squeezed").exists()
    assert adapter_store().version(f"{BASE}:squeezed") is None


def test_compositions_under_way_are_capped_per_organization_with_when_to_retry_and_nothing_queued(
    alice, charlie, parents, settings, sent, make_adapter  # noqa: F811
):
    lower_limits(settings, compositions_at_once_per_organization=2)
    left, right, _ = parents
    body = {"parents": [{"model": left, "scale": 1.0}, {"model": right, "scale": 1.0}], "method": "svd", "rank": 8}
    first, second = (queued(compose(alice, **body, suffix=f"capped-{n}")) for n in (1, 2))
    refused = compose(alice, **body, suffix="capped-3")
    error = refused.json()["error"]
    assert refused.status_code == 429 and error["code"] == "too_many_compositions", error
    assert "COMPOSITIONS_AT_ONCE_PER_ORGANIZATION" in error["message"] and "Try again in" in error["message"]
    assert int(refused["Retry-After"]) > 0
    assert sent == [first["id"], second["id"]]  # the refused one was not queued
    assert finetuning_models.Composition.objects.count() == 2

    theirs = published(charlie, "theirs", make_adapter(seed=14))  # another organization is not held back
    assert queued(compose(charlie, parents=[{"model": theirs, "scale": 1.0}], method="svd", rank=4, suffix="capped-3"))

    run_composition(first["id"], "test")  # one has finished: a slot is free
    assert queued(compose(alice, **body, suffix="kept"))
    assert compose(alice, parents=body["parents"], suffix="blend").status_code == 200  # linear is not capped: it is done at once


def test_the_sweeper_fails_a_composition_whose_worker_died_and_sends_again_one_whose_message_was_lost(
    alice, parents, sent
):
    from workers.sweep import sweep

    left = next(iter(parents))
    body = {"parents": [{"model": left, "scale": 1.0}], "method": "svd", "rank": 4}
    lost_message, lost_worker = (queued(compose(alice, **body, suffix=f"capped-{n}"))["id"] for n in (1, 2))
    long_ago = timezone.now() - timedelta(minutes=30)  # longer than any worker may run it
    finetuning_models.Composition.objects.filter(pk=lost_worker).update(status="running", started_at=long_ago)

    swept = sweep(lost_after=timedelta(0))
    assert swept["compositions_failed"] == [lost_worker] and swept["compositions_resent"] == [lost_message]
    assert sent == [lost_message, lost_worker, lost_message]
    failed = alice.api.get(f"{COMPOSITIONS}/{lost_worker}").json()
    assert failed["status"] == "failed" and failed["error"]["code"] == "worker_lost"
    assert queued(compose(alice, **body, suffix="capped-2"))  # its suffix and its slot are free again


def test_a_composition_created_while_the_broker_is_down_answers_503_builds_nothing_and_frees_its_suffix(
    alice, parents, web_without_broker, sent  # noqa: F811
):
    left, right, _ = parents
    body = {"parents": [{"model": left, "scale": 1.0}, {"model": right, "scale": 1.0}], "method": "ties", "suffix": "refused"}
    headers = {"Authorization": f"Bearer {alice.key}"}
    response = httpx.post(f"{web_without_broker}{COMPOSE}", headers=headers, json=body, timeout=60)
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["code"] == "broker_unavailable" and "compose it again" in error["message"]
    assert "redis" not in error["message"].lower() and "127.0.0.1" not in error["message"]  # no internal detail
    composition = finetuning_models.Composition.objects.get(model=f"{BASE}:refused")
    assert composition.status == "failed" and composition.error_code == "broker_unavailable"
    assert not FineTunedModel.objects.filter(suffix="refused").exists()
    assert queued(compose(alice, parents=body["parents"], method="ties", suffix="refused"))  # the suffix is free


def test_compositions_per_hour_are_limited_per_organization_with_retry_after(alice, parents, settings, sent):
    lower_limits(settings, compositions_per_hour_per_organization=2)
    left = next(iter(parents))
    one = [{"model": left, "scale": 1.0}]
    assert compose(alice, parents=one, suffix="hourly-1").status_code == 200  # linear counts too
    queued(compose(alice, parents=one, method="svd", rank=4, suffix="hourly-2"))
    refused = compose(alice, parents=one, method="svd", rank=4, suffix="hourly-3")
    error = refused.json()["error"]
    assert refused.status_code == 429 and error["code"] == "rate_limit_exceeded", error
    assert "COMPOSITIONS_PER_HOUR_PER_ORGANIZATION" in error["message"] and "Try again in" in error["message"]
    assert 1 <= int(refused["Retry-After"]) <= 3600
    assert len(sent) == 1 and finetuning_models.Composition.objects.count() == 1


def test_a_composed_model_outlives_its_parents_with_its_lineage(alice, parents, tmp_path):
    left, right, _ = parents
    assert compose(alice, parents=[{"model": left, "scale": 1.0}, {"model": right, "scale": -0.5}], suffix="kept").status_code == 200
    assert alice.api.delete(f"/v1/models/{left}").status_code == 200
    listed = {model["id"]: model for model in alice.api.get("/v1/models").json()["data"]}
    assert left not in listed and listed[f"{BASE}:kept"]["lineage"]["parents"][0] == {"model": left, "scale": 1.0}
    assert adapter_store().fetch(f"{BASE}:kept", tmp_path / "cache").is_dir()


def _refusals(parents: list[str]) -> dict[str, tuple[dict | list | str, int, str | None, str]]:
    """case: (body, status, error code (None: a field's, named by 'param'), words of the message)."""
    left, right, third = parents
    one = [{"model": left, "scale": 1.0}]
    return {
        "no parents": ({"parents": []}, 400, None, "parents"),
        "a base model": ({"parents": [{"model": BASE, "scale": 1.0}]}, 400, "invalid_parents", "is a base model"),
        "unknown model": ({"parents": [{"model": f"{BASE}:nobody", "scale": 1.0}]}, 404, "model_not_found", f"{BASE}:nobody"),
        "every scale zero": ({"parents": [{"model": left, "scale": 0.0}]}, 400, "invalid_parents", "base model itself"),
        "scale out of range": ({"parents": [{"model": left, "scale": 3.0}]}, 400, None, "scale"),
        "scale a string": ({"parents": [{"model": left, "scale": "0.5"}]}, 400, None, "scale"),
        "unknown key": ({"parents": one, "weights": [1]}, 400, None, "weights"),
        "unknown key in a parent": ({"parents": [{"model": left, "scale": 1.0, "path": "/etc"}]}, 400, None, "path"),
        "unknown method": ({"parents": one, "method": "average"}, 400, None, "method"),
        "a rank for linear": ({"parents": one, "rank": 4}, 400, "invalid_rank", "approximation"),
        "a rank over the served": ({"parents": one, "method": "svd", "rank": 32}, 400, "limit_exceeded", "max_lora_rank"),
        "density zero": ({"parents": one, "method": "ties", "density": 0}, 400, None, "density"),
        "too many parents": (
            {"parents": [{"model": f"{BASE}:p{i}", "scale": 1.0} for i in range(9)]}, 400, "limit_exceeded", "MAX_MIX_ADAPTERS",
        ),
        "a path as suffix": ({"parents": one, "suffix": "../../etc"}, 400, "invalid_suffix", "suffix"),
        "a taken suffix": ({"parents": one, "suffix": "right"}, 409, "suffix_taken", "right"),
        "not an object": ([1, 2], 400, "invalid_body", "JSON object"),
        "malformed JSON": ('{"parents": [', 400, "invalid_body", "JSON parse error"),
        "ties of an unknown model": (
            {"parents": [{"model": f"{BASE}:nobody", "scale": 1.0}], "method": "ties"}, 404, "model_not_found", "nobody",
        ),
        "ties at a rank over the served": ({"parents": one, "method": "ties", "rank": 17}, 400, "limit_exceeded", "max_lora_rank"),
        "dare with density over 1": ({"parents": one, "method": "dare_linear", "density": 1.5}, 400, None, "density"),
        "svd under a taken suffix": ({"parents": one, "method": "svd", "suffix": "right"}, 409, "suffix_taken", "right"),
        "svd of a base model": ({"parents": [{"model": BASE, "scale": 1.0}], "method": "svd"}, 400, "invalid_parents", "base model"),
    }


def test_every_bad_composition_is_refused_with_what_to_fix_and_writes_or_queues_nothing(alice, parents, sent):
    models_before = set(FineTunedModel.objects.values_list("name", flat=True))
    failures = []
    for case, (body, status, code, words) in _refusals(list(parents)).items():
        if isinstance(body, str):
            response = alice.api.generic("POST", COMPOSE, body, content_type="application/json")
        else:
            if isinstance(body, dict):
                body = {"suffix": "refused"} | body
            response = alice.api.post(COMPOSE, body, format="json")
        error = response.json().get("error", {})
        if response.status_code != status or error.get("code") != code or words not in error.get("message", ""):
            failures.append((case, response.status_code, error))
    assert not failures, "\n".join(map(str, failures))
    assert set(FineTunedModel.objects.values_list("name", flat=True)) == models_before
    assert adapter_store().version(f"{BASE}:refused") is None
    assert sent == [] and not finetuning_models.Composition.objects.exists()


@pytest.mark.parametrize("method", ["linear", "ties"])
def test_another_organizations_models_cannot_be_composed(alice, charlie, parents, make_adapter, method, sent):  # noqa: F811
    theirs = published(charlie, "theirs", make_adapter(seed=14))
    left = next(iter(parents))
    body = {"parents": [{"model": left, "scale": 1.0}, {"model": theirs, "scale": 1.0}], "method": method}
    response = compose(alice, **body, suffix="refused")
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
    assert response.json()["error"]["param"] == "parents"
    assert not FineTunedModel.objects.filter(suffix="refused").exists()
    assert sent == [] and not finetuning_models.Composition.objects.exists()


def test_another_organizations_composition_is_a_404(alice, charlie, parents, sent):
    left = next(iter(parents))
    composition = queued(compose(alice, parents=[{"model": left, "scale": 1.0}], method="svd", rank=4, suffix="kept"))
    response = charlie.api.get(f"{COMPOSITIONS}/{composition['id']}")
    assert response.status_code == 404 and response.json()["error"]["code"] == "composition_not_found"
    assert charlie.api.get(COMPOSITIONS).json()["data"] == []


def run_composition(composition_id: str, worker: str) -> str:
    """What the worker's task runs, here in the test's process."""
    from workers.run_composition import run_composition as run

    return run(composition_id, worker)


def test_a_composition_whose_weights_overflow_half_precision_is_refused_naming_the_tensor(alice, tmp_path):
    """Each parent fits what the serving kernel holds (half precision); their scaled sum does not:
    the composed adapter is checked like an upload, and nothing is written."""
    from tests.adapter_archives import A_NAME, HIDDEN, files, weights

    folders = []
    for number, value in enumerate([40_000.0, 1.0]):  # lora_alpha / r = 2 moves into A when composed
        folder = tmp_path / f"parent-{number}"
        folder.mkdir()
        for file, data in files(weights=weights(a=np.full((1, HIDDEN), value, np.float32))).items():
            (folder / file).write_bytes(data)
        folders.append(folder)
    left, right = published(alice, "left", folders[0]), published(alice, "right", folders[1])

    response = compose(alice, parents=[{"model": left, "scale": 1.0}, {"model": right, "scale": 1.0}], suffix="refused")
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == "invalid_adapter", error
    assert A_NAME in error["message"] and "65504" in error["message"], error
    assert not FineTunedModel.objects.filter(suffix="refused").exists()
    assert adapter_store().version(f"{BASE}:refused") is None
