"""Composed models through the dashboard: the form calls the same service as ``POST
/v1/fine_tuning/models`` (``finetuning.compositions``), and the models page shows each one's
lineage, and the status of those built on a worker."""

from __future__ import annotations

import pytest
from django.urls import reverse

from finetuning import models as finetuning_models
from finetuning.models import FineTunedModel
from tests.compositions import SUFFIXES as API_SUFFIXES
from tests.compositions import parents  # noqa: F401
from tests.inference_fixtures import BASE, adapter_store, make_adapter, register_fine_tuned_model  # noqa: F401

pytestmark = pytest.mark.django_db

SUFFIXES = ["dash-blend", "dash-approx", "dash-refused"]


@pytest.fixture(autouse=True)
def _fresh_store():
    """The dynamic path outlives the test database: no adapter of an earlier run under our names."""
    for suffix in SUFFIXES + API_SUFFIXES:
        adapter_store().delete(f"{BASE}:{suffix}")
    yield
    for suffix in SUFFIXES + API_SUFFIXES:
        adapter_store().delete(f"{BASE}:{suffix}")


@pytest.fixture
def alice_web(client, alice, settings):
    settings.INFERENCE_POOL_URL = "http://127.0.0.1:9"  # which models are loaded does not matter here
    client.force_login(alice.user)
    return client


def compose_form(client, scales: dict[str, float | str], suffix: str, **options):
    """The form as a person sends it: ``scales`` are the ticked models (a scale '' leaves it empty)."""
    fields = {"compose-parents": list(scales), "compose-suffix": suffix, "compose-method": "linear"}
    fields |= {f"compose-scale_{name}": scale for name, scale in scales.items()}
    fields |= {f"compose-{name}": value for name, value in options.items()}
    return client.post(reverse("dashboard:model_compose"), fields)


def block_of(page: str, name: str) -> str:
    """The field's block (label, inputs, errors) on the page: a <div>, or the parents' <fieldset>."""
    start = page.index(f'id="field-{name}"')
    tag = page[page.rindex("<", 0, start) + 1 : start].split()[0]
    return page[start : page.index(f"</{tag}>", start)]


def row_of(page: str, name: str) -> str:
    start = page.index(f'data-model="{name}"')
    return page[start : page.index("</tr>", start)]


def test_a_model_composed_on_the_form_is_listed_with_its_lineage_and_a_deleted_parent_says_so(
    alice_web, alice, charlie, parents  # noqa: F811
):
    left, right, third = parents
    theirs = register_fine_tuned_model(charlie, "dash-theirs")
    form = alice_web.get(reverse("dashboard:model_compose")).content.decode()
    assert all(f'data-parent="{name}"' in form for name in parents) and theirs not in form

    response = compose_form(alice_web, {left: "0.5", right: "-0.5"}, "dash-blend")
    assert response.status_code == 302 and response["Location"] == reverse("dashboard:models"), response.content
    name = f"{BASE}:dash-blend"
    lineage = FineTunedModel.objects.get(name=name).lineage
    assert lineage == {
        "origin": "composed", "parents": [{"model": left, "scale": 0.5}, {"model": right, "scale": -0.5}],
        "method": "linear", "rank": 16, "approximation_error": 0.0,
    }
    assert adapter_store().version(name) is not None

    page = alice_web.get(reverse("dashboard:models")).content.decode()
    assert f"{name} is published (approximation error 0)" in page
    row = row_of(page, name)
    assert "composed of" in row and "linear, LoRA r 16, approximation error 0" in row
    assert f'<a href="#model-{left}"><code>{left}</code></a> × 0.5' in row
    assert f'<a href="#model-{right}"><code>{right}</code></a> × -0.5' in row
    assert f'id="model-{left}"' in page  # where the parent's link goes
    assert "uploaded adapter" not in row and third not in row
    assert "composed of" not in row_of(page, left)  # a trained model's lineage is its job, as before

    alice_web.post(reverse("dashboard:model_delete", args=[right]))
    row = row_of(alice_web.get(reverse("dashboard:models")).content.decode(), name)
    assert f"<code>{right}</code> (deleted) × -0.5" in row and f'href="#model-{right}"' not in row
    assert f'href="#model-{left}"' in row


def test_an_approximation_from_the_form_is_queued_its_status_shown_and_its_error_named_once_published(
    alice_web, alice, parents  # noqa: F811
):
    response = compose_form(alice_web, dict.fromkeys(parents, ""), "dash-approx", method="svd", rank="12")
    assert response.status_code == 302 and response["Location"] == reverse("dashboard:models"), response.content
    name = f"{BASE}:dash-approx"
    composition = finetuning_models.Composition.objects.get(model=name)
    assert composition.status == "queued" and composition.created_by == alice.user
    assert [parent["scale"] for parent in composition.parents] == [1.0] * 3  # an empty scale is 1
    assert not FineTunedModel.objects.filter(name=name).exists()  # not built in the request

    page = alice_web.get(reverse("dashboard:models")).content.decode()
    assert f"{name} is being composed (svd) on a worker" in page
    row = composition_row(page, composition.id)
    assert 'data-status="queued"' in row and "svd, LoRA r 12" in row
    assert "location.reload()" in page  # it looks again until the composition has finished

    assert run_composition(composition.id, "test") == "succeeded"  # what the worker runs
    lineage = FineTunedModel.objects.get(name=name).lineage
    assert lineage["method"] == "svd" and lineage["rank"] == 12
    assert 0 < lineage["approximation_error"] < 1
    page = alice_web.get(reverse("dashboard:models")).content.decode()
    assert 'data-status="succeeded"' in composition_row(page, composition.id) and "location.reload()" not in page
    assert "svd, LoRA r 12, approximation error 0." in row_of(page, name)


def test_a_failed_composition_shows_its_reason_on_the_models_page(alice_web, alice, parents):  # noqa: F811
    left, right, _ = parents
    compose_form(alice_web, {left: 1, right: 1}, "dash-approx", method="ties", rank="8")
    composition = finetuning_models.Composition.objects.get(model=f"{BASE}:dash-approx")
    alice_web.post(reverse("dashboard:model_delete", args=[right]))  # before the worker gets to it
    assert run_composition(composition.id, "test") == "failed"
    row = composition_row(alice_web.get(reverse("dashboard:models")).content.decode(), composition.id)
    assert 'data-status="failed"' in row and right in row and "Nothing was published" in row


def composition_row(page: str, composition_id: str) -> str:
    start = page.index(f'data-composition="{composition_id}"')
    return page[start : page.index("</tr>", start)]


def run_composition(composition_id: str, worker: str) -> str:
    from workers.run_composition import run_composition as run

    return run(composition_id, worker)


def _refusals(left: str, right: str, third: str) -> dict[str, tuple[dict, dict, str, str]]:
    """case: (scales, other fields, the field the reason shows next to, words of the reason)."""
    return {
        "an exact sum over the served rank": (
            {left: 1, right: 1, third: 1}, {}, "parents", "rank 24 (the sum of their ranks"
        ),
        "a taken suffix": ({left: 1}, {"suffix": "right"}, "suffix", "The suffix is taken"),
        "every scale 0": ({left: 0, right: "0"}, {}, "parents", "base model itself"),
        "nothing ticked": ({}, {}, "parents", "at least one"),
        "a rank for linear": ({left: 1}, {"rank": "4"}, "rank", "approximation"),
        "a rank over the served": ({left: 1}, {"method": "svd", "rank": "32"}, "rank", "max_lora_rank"),
        "ties under a taken suffix": ({left: 1}, {"method": "ties", "suffix": "right"}, "suffix", "The suffix is taken"),
        "a scale out of range": ({left: 3}, {}, f"scale_{left}", "less than or equal to 2"),
    }


@pytest.mark.parametrize("case", list(_refusals("l", "r", "t")))
def test_a_refused_composition_shows_its_reason_on_the_form_and_creates_nothing(alice_web, parents, case):  # noqa: F811
    scales, options, field, reason = _refusals(*parents)[case]
    before = set(FineTunedModel.objects.values_list("name", flat=True))
    response = compose_form(alice_web, scales, options.pop("suffix", "dash-refused"), **options)

    assert response.status_code == 200  # the form again, not a redirect
    block = block_of(response.content.decode(), field)
    assert reason in block and 'class="field-error"' in block, block
    assert set(FineTunedModel.objects.values_list("name", flat=True)) == before
    assert adapter_store().version(f"{BASE}:dash-refused") is None
    assert not finetuning_models.Composition.objects.exists()  # nothing queued either


def test_naming_another_organizations_model_is_a_404_that_composes_nothing(
    client, alice, charlie, parents  # noqa: F811
):
    left = next(iter(parents))
    client.force_login(charlie.user)
    response = compose_form(client, {left: 1}, "dash-refused")
    assert response.status_code == 404
    assert "does not exist or you do not have access to it" in block_of(response.content.decode(), "parents")
    assert not FineTunedModel.objects.filter(organization=charlie.organization).exists()
