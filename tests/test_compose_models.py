"""Composed models through the API: a weighted combination of an organization's fine-tuned models,
published under its own suffix with its lineage; refusals say what to fix and write nothing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from core.adapter_store import CONFIG_FILE, WEIGHTS_FILE
from core.lora_algebra import read_tensors
from finetuning.models import FineTunedModel
from finetuning.quotas import stored_bytes
from tests.inference_fixtures import BASE, adapter_store, make_adapter  # noqa: F401
from tests.test_adapter_io import published

pytestmark = pytest.mark.django_db(transaction=True)

COMPOSE = "/v1/fine_tuning/models"
SUFFIXES = ["left", "right", "third", "blend", "approx", "tied", "dared", "refused", "kept", "theirs"]


@pytest.fixture(autouse=True)
def _fresh_store():
    """The dynamic path outlives the test database: no adapter of an earlier run under our names."""
    for suffix in SUFFIXES:
        adapter_store().delete(f"{BASE}:{suffix}")


@pytest.fixture
def parents(alice, make_adapter) -> dict[str, Path]:  # noqa: F811
    """Three of alice's fine-tuned models, rank 8 each (max_lora_rank is 16), by name."""
    folders = [make_adapter(seed=11), make_adapter(seed=12), make_adapter(seed=13)]
    return {published(alice, suffix, folder): folder for suffix, folder in zip(["left", "right", "third"], folders)}


def compose(persona, **body):
    return persona.api.post(COMPOSE, body, format="json")


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
    }  # fmt: skip
    assert response.json() | {"created": 0} == {
        "id": name, "object": "model", "created": 0, "owned_by": alice.organization.slug, "parent": BASE, "lineage": lineage,
        "revision": 1,
    }  # fmt: skip
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

    response = compose(alice, parents=three, suffix="approx", method="svd", rank=12)
    assert response.status_code == 200, response.json()
    lineage = response.json()["lineage"]
    assert lineage["method"] == "svd" and lineage["rank"] == 12
    assert 0 < lineage["approximation_error"] < 1  # rank 12 of a rank-24 sum: something is lost, not all


@pytest.mark.parametrize("method", ["ties", "dare_linear"])
def test_ties_and_dare_compose_at_the_served_rank_by_default_and_record_their_settings(alice, parents, method):
    left, right, _ = parents
    suffix = {"ties": "tied", "dare_linear": "dared"}[method]
    body = {"parents": [{"model": left, "scale": 1.0}, {"model": right, "scale": 0.7}], "method": method, "density": 0.3}
    response = compose(alice, **body, suffix=suffix)
    assert response.status_code == 200, response.json()
    lineage = response.json()["lineage"]
    assert lineage["rank"] == 16 and lineage["density"] == 0.3 and lineage["approximation_error"] > 0
    assert ("seed" in lineage) == (method == "dare_linear")
    assert adapter_store().version(f"{BASE}:{suffix}") is not None


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
    }


def test_every_bad_composition_is_refused_with_what_to_fix_and_writes_nothing(alice, parents):
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


def test_another_organizations_models_cannot_be_composed(alice, charlie, parents, make_adapter):  # noqa: F811
    theirs = published(charlie, "theirs", make_adapter(seed=14))
    left = next(iter(parents))
    response = compose(alice, parents=[{"model": left, "scale": 1.0}, {"model": theirs, "scale": 1.0}], suffix="refused")
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
    assert response.json()["error"]["param"] == "parents"
    assert not FineTunedModel.objects.filter(suffix="refused").exists()


def test_a_composition_whose_weights_overflow_half_precision_is_refused_naming_the_tensor(alice, tmp_path):
    """Each parent fits what the serving kernel holds (half precision); their scaled sum does not:
    the composed adapter is checked like an upload, and nothing is written."""
    from tests.test_hostile_archives import A_NAME, HIDDEN, files, weights

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
