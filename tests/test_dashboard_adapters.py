"""Adapters in and out through the dashboard: the same downloads and uploads as the API
(``finetuning.adapters``), as links and a form for a person."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from django.urls import reverse

from finetuning.models import FineTunedModel
from tests.adapter_archives import (
    _checkpoint_of,
    _wrong_shapes,
    adapter_files,
    body_of,
    field_of,
    tar_gz,
    unpacked,
    upload_form,
)
from tests.inference_fixtures import BASE, adapter_store, make_adapter, register_fine_tuned_model  # noqa: F401
from tests.inference_fixtures import publish_fine_tuned_model as published
from tests.limits import lower_limits

pytestmark = pytest.mark.django_db

SUFFIXES = ["dash-download", "dash-checkpointed", "dash-uploaded", "dash-refused", "dash-taken"]


@pytest.fixture(autouse=True)
def _fresh_store():
    """The dynamic path outlives the test database: no adapter of an earlier run under our names."""
    for suffix in SUFFIXES:
        adapter_store().delete(f"{BASE}:{suffix}")
    yield
    for suffix in SUFFIXES:
        adapter_store().delete(f"{BASE}:{suffix}")


@pytest.fixture
def adapter(make_adapter) -> Path:  # noqa: F811
    return make_adapter(seed=11)


@pytest.fixture
def alice_web(client, alice, settings):
    settings.INFERENCE_POOL_URL = "http://127.0.0.1:9"  # which models are loaded does not matter here
    client.force_login(alice.user)
    return client


def test_the_models_page_downloads_a_models_adapter_that_unpacks_to_the_peft_folder(
    alice_web, alice, adapter, tmp_path
):
    name = published(alice, "dash-download", adapter)
    page = alice_web.get(reverse("dashboard:models")).content.decode()
    link = reverse("dashboard:model_adapter", args=[name])
    row = page[page.index(f'data-model="{name}"') :]
    assert f'href="{link}"' in row[: row.index("</tr>")]

    response = alice_web.get(link)
    assert response.status_code == 200 and response["Content-Type"] == "application/gzip"
    assert 'filename="HuggingFaceTB--SmolLM2-135M-Instruct--dash-download.tar.gz"' in response["Content-Disposition"]
    folder = unpacked(body_of(response), tmp_path / "downloaded")  # exactly the two files, at the root
    assert adapter_files(folder) == adapter_files(adapter)


def test_the_job_page_downloads_each_checkpoints_adapter(alice_web, alice, adapter, tmp_path):
    name = published(alice, "dash-checkpointed", adapter)
    checkpoint = _checkpoint_of(alice, name, adapter)
    page = alice_web.get(reverse("dashboard:job", args=[checkpoint.job_id])).content.decode()
    link = reverse("dashboard:checkpoint_adapter", args=[checkpoint.job_id, checkpoint.id])
    assert f'href="{link}"' in page

    response = alice_web.get(link)
    assert response.status_code == 200
    assert "dash-checkpointed--ckpt-step-3.tar.gz" in response["Content-Disposition"]
    assert adapter_files(unpacked(body_of(response), tmp_path / "checkpoint")) == adapter_files(adapter)


def test_a_download_of_an_adapter_no_longer_stored_goes_back_to_the_models_page_saying_so(alice_web, alice):
    name = register_fine_tuned_model(alice, "dash-download")  # registered, never published
    response = alice_web.get(reverse("dashboard:model_adapter", args=[name]), follow=True)
    assert response.redirect_chain == [(reverse("dashboard:models"), 302)]
    assert "adapter" in response.content.decode().lower() and 'class="flash error"' in response.content.decode()


def test_an_adapter_uploaded_from_the_form_is_published_and_listed_on_the_models_page(alice_web, alice, adapter):
    form = alice_web.get(reverse("dashboard:adapter_upload")).content.decode()
    assert f'<option value="{BASE}">' in form and 'data-max-bytes=' in form
    response = upload_form(alice_web, tar_gz(adapter_files(adapter)), "dash-uploaded")
    assert response.status_code == 302 and response["Location"] == reverse("dashboard:models"), response.content

    name = f"{BASE}:dash-uploaded"
    row = FineTunedModel.objects.get(name=name)
    assert row.organization == alice.organization and row.job is None and row.uploaded_bytes > 0
    assert adapter_store().version(name) is not None
    page = alice_web.get(reverse("dashboard:models")).content.decode()
    listed = page[page.index(f'data-model="{name}"') :]
    assert "uploaded adapter (trained elsewhere)" in listed[: listed.index("</tr>")]
    assert f"{name} is published" in page


def _taken(alice, adapter):
    register_fine_tuned_model(alice, "dash-taken")
    return tar_gz(adapter_files(adapter)), "dash-taken"


REFUSED = {
    # case: (archive and suffix, the field the reason shows next to, words of the reason, the API's status)
    "wrong shapes": (lambda alice, a: (tar_gz(_wrong_shapes(a)), "dash-refused"), "file", "has shape [8, 100]", 400),
    "not an archive": (lambda alice, a: (b"just some bytes", "dash-refused"), "file", "not a readable .tar.gz or .zip", 400),
    "suffix taken": (_taken, "suffix", "The suffix is taken", 409),
    "too large": (lambda alice, a: (tar_gz(adapter_files(a)), "dash-refused"), "file", "MAX_ADAPTER_UPLOAD_MB", 400),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_refused_upload_shows_its_reason_on_the_form_and_registers_nothing(alice_web, alice, adapter, settings, case):
    make, field, reason, status = REFUSED[case]
    archive, suffix = make(alice, adapter)
    if case == "too large":
        settings.CONFIG = dataclasses.replace(settings.CONFIG, max_adapter_upload_bytes=len(archive) - 1)
    before = set(FineTunedModel.objects.values_list("name", flat=True))

    response = upload_form(alice_web, archive, suffix)
    assert response.status_code == status  # the form again (not a redirect), with the API's status
    page = response.content.decode()
    assert reason in field_of(page, field), field_of(page, field)
    assert 'class="field-error"' in field_of(page, field)
    assert set(FineTunedModel.objects.values_list("name", flat=True)) == before
    if case != "suffix taken":
        assert adapter_store().version(f"{BASE}:{suffix}") is None


def test_an_upload_over_the_storage_quota_is_refused_on_the_form(alice_web, adapter, settings):
    lower_limits(settings, storage_bytes_per_organization=1024)
    response = upload_form(alice_web, tar_gz(adapter_files(adapter)), "dash-refused")
    assert response.status_code == 403
    assert "quota" in field_of(response.content.decode(), "file")
    assert not FineTunedModel.objects.exists() and adapter_store().version(f"{BASE}:dash-refused") is None
