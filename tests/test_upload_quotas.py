# ruff: noqa: F811 (pytest fixtures are imported, then named as arguments)
"""Uploads per hour and bytes kept, per organization: over either, the upload is refused and
nothing of it is stored."""

from __future__ import annotations

import pytest

from core.object_store import ObjectNotFound
from finetuning import quotas, storage
from finetuning.models import File
from tests.file_uploads import error_of, stored_keys, upload  # noqa: F401 (a fixture)
from tests.limits import lower_limits, own_counters  # noqa: F401 (a fixture)
from tests.personas import good_dataset

pytestmark = pytest.mark.django_db


def test_it_refuses_an_upload_past_the_hourly_rate_with_retry_after_and_stores_nothing(
    alice, charlie, stored_keys, settings
):
    lower_limits(settings, uploads_per_hour_per_organization=2)
    assert [upload(alice, good_dataset()).status_code for _ in range(2)] == [200, 200]

    refused = upload(alice, good_dataset())
    assert refused.status_code == 429
    assert 1 <= int(refused["Retry-After"]) <= 3600
    error = error_of(refused)
    assert error["code"] == "rate_limit_exceeded" and "UPLOADS_PER_HOUR_PER_ORGANIZATION" in error["message"]
    assert File.objects.for_org(alice.organization).count() == 2 and len(stored_keys) == 2

    assert upload(charlie, good_dataset()).status_code == 200  # another organization is not held back


def test_it_refuses_a_file_that_would_pass_the_storage_quota_and_stores_nothing(alice, charlie, stored_keys, settings):
    size = len(good_dataset())
    lower_limits(settings, storage_bytes_per_organization=size * 3 // 2)
    first = upload(alice, good_dataset())
    assert first.status_code == 200

    refused = upload(alice, good_dataset())
    assert refused.status_code == 403
    error = error_of(refused)
    assert error["code"] == "storage_quota_exceeded" and "STORAGE_MB_PER_ORGANIZATION" in error["message"]
    assert File.objects.for_org(alice.organization).count() == 1 and len(stored_keys) == 1

    assert upload(charlie, good_dataset()).status_code == 200  # its own quota
    alice.api.delete(f"/v1/files/{first.json()['id']}")
    assert upload(alice, good_dataset()).status_code == 200  # deleting files frees the quota


def test_it_deletes_the_bytes_of_a_file_whose_quota_another_upload_took_meanwhile(
    alice, stored_keys, settings, monkeypatch
):
    lower_limits(settings, storage_bytes_per_organization=len(good_dataset()) * 3 // 2)
    assert upload(alice, good_dataset()).status_code == 200
    check = quotas.check_storage
    # As if the other upload committed between this one's first check and its locked one.
    monkeypatch.setattr(quotas, "check_storage", lambda org, size, locked=False: locked and check(org, size, locked))

    assert upload(alice, good_dataset()).status_code == 403
    assert File.objects.for_org(alice.organization).count() == 1 and len(stored_keys) == 2
    with pytest.raises(ObjectNotFound):
        storage.files().get(stored_keys[1])
