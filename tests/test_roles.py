"""Owners manage an organization; members use it. alice owns Acme, bob is her teammate."""

import pytest
from django.test import Client
from django.urls import reverse

from accounts.models import ApiKey
from accounts.services import create_api_key
from finetuning.models import FineTunedModel
from tests.inference_fixtures import register_fine_tuned_model

pytestmark = pytest.mark.django_db(transaction=True)  # the gateway reads the database in other threads


def web(persona) -> Client:
    client = Client()
    client.force_login(persona.user)
    return client


def test_a_member_revokes_his_own_keys_but_not_the_owners(alice, bob):
    alices_key = ApiKey.objects.get(created_by=alice.user)
    bobs_key = ApiKey.objects.get(created_by=bob.user)
    refused = web(bob).post(reverse("dashboard:api_key_revoke", args=[alices_key.prefix]))
    assert refused.status_code == 403 and "only an owner" in refused.content.decode()
    assert ApiKey.objects.get(pk=alices_key.pk).is_active
    assert web(bob).post(reverse("dashboard:api_key_revoke", args=[bobs_key.prefix])).status_code == 302
    assert not ApiKey.objects.get(pk=bobs_key.pk).is_active


def test_a_member_cannot_delete_a_model_from_the_dashboard_or_the_api(alice, bob):
    name = register_fine_tuned_model(alice, "kept")
    model = FineTunedModel.objects.get(name=name)
    assert web(bob).post(reverse("dashboard:model_delete", args=[model.name])).status_code == 403
    response = bob.api.delete(f"/v1/models/{name}")
    assert response.status_code == 403 and response.json()["error"]["code"] == "permission_denied"
    assert FineTunedModel.objects.filter(pk=model.pk).exists()
    assert alice.api.delete(f"/v1/models/{name}").json()["deleted"] is True  # the owner may


def test_an_owner_can_let_members_manage_and_only_an_owner_can(alice, bob):
    name = register_fine_tuned_model(alice, "shared")
    spare = create_api_key(alice.organization, alice.user, "spare")[0]
    assert web(bob).post(reverse("dashboard:members_may_manage"), {"allowed": "on"}).status_code == 403
    assert web(alice).post(reverse("dashboard:members_may_manage"), {"allowed": "on"}).status_code == 302
    assert bob.api.delete(f"/v1/models/{name}").status_code == 200
    assert web(bob).post(reverse("dashboard:api_key_revoke", args=[spare.prefix])).status_code == 302
    assert not ApiKey.objects.get(pk=spare.pk).is_active
    page = web(alice).get(reverse("dashboard:api_keys")).content.decode()
    assert 'id="members-may-manage"' in page and "checked" in page
    assert 'id="members-may-manage"' not in web(bob).get(reverse("dashboard:api_keys")).content.decode()
