import pytest
from django.contrib.auth.models import User
from django.core.management import CommandError, call_command
from rest_framework.exceptions import AuthenticationFailed
from rest_framework.test import APIRequestFactory

from accounts.authentication import BearerKeyAuthentication
from accounts.models import ApiKey, Membership, Organization
from accounts.services import create_api_key, create_organization, revoke_api_key

pytestmark = pytest.mark.django_db


@pytest.fixture
def alice():
    return User.objects.create_user("alice", password="pw")


def _authenticate(header: str | None):
    request = APIRequestFactory().get("/", **({"HTTP_AUTHORIZATION": header} if header else {}))
    return BearerKeyAuthentication().authenticate(request)


def test_it_authenticates_a_bearer_key_for_its_organization(alice):
    org = create_organization("Acme", owner=alice)
    api_key, raw = create_api_key(org, alice, "laptop")
    user, auth = _authenticate(f"Bearer {raw}")
    assert user == alice and auth == api_key and auth.organization == org


def test_it_keeps_only_a_hash_of_the_key(alice):
    org = create_organization("Acme", owner=alice)
    api_key, raw = create_api_key(org, alice, "laptop")
    stored = ApiKey.objects.get(pk=api_key.pk)
    assert raw not in (stored.hashed_key, stored.prefix) and raw.startswith(stored.prefix)


@pytest.mark.parametrize("header", ["Bearer sk-not-a-key", "Token abc", "Bearer "])
def test_it_refuses_wrong_keys_with_a_message(alice, header):
    with pytest.raises(AuthenticationFailed) as error:
        _authenticate(header)
    assert "API key" in str(error.value.detail)


def test_a_revoked_key_stops_working(alice):
    org = create_organization("Acme", owner=alice)
    api_key, raw = create_api_key(org, alice, "laptop")
    revoke_api_key(api_key)
    with pytest.raises(AuthenticationFailed, match="revoked"):
        _authenticate(f"Bearer {raw}")


def test_a_key_stops_working_when_its_maker_leaves_the_organization(alice):
    org = create_organization("Acme", owner=alice)
    _, raw = create_api_key(org, alice, "laptop")
    Membership.objects.filter(user=alice, organization=org).delete()
    with pytest.raises(AuthenticationFailed):
        _authenticate(f"Bearer {raw}")


def test_a_key_stops_working_when_its_maker_is_deactivated(alice):
    org = create_organization("Acme", owner=alice)
    _, raw = create_api_key(org, alice, "laptop")
    alice.is_active = False
    alice.save()
    with pytest.raises(AuthenticationFailed):
        _authenticate(f"Bearer {raw}")


def test_a_key_of_a_member_of_two_organizations_acts_only_for_its_own(alice):
    acme, globex = create_organization("Acme", owner=alice), create_organization("Globex", owner=alice)
    api_key, raw = create_api_key(acme, alice, "laptop")
    Membership.objects.filter(user=alice, organization=globex).delete()
    assert _authenticate(f"Bearer {raw}")[1] == api_key  # leaving another organization changes nothing


def test_organization_slugs_stay_unique(alice):
    assert create_organization("Acme", alice).slug == "acme"
    assert create_organization("Acme", alice).slug == "acme-2"


def test_the_demo_bootstrap_is_idempotent_and_prints_a_working_key(capsys, settings, tmp_path):
    settings.DEBUG = True  # development mode, as bin/run starts it for local use
    settings.DATA_DIR = tmp_path
    call_command("bootstrap_demo")
    first = capsys.readouterr().out.strip()
    call_command("bootstrap_demo")
    assert capsys.readouterr().out.strip() == first
    user, _ = _authenticate(f"Bearer {first}")
    assert user.username == "demo" and user.check_password("demo")
    assert Organization.objects.filter(memberships__user=user).count() == 1

    revoke_api_key(ApiKey.objects.get(organization__memberships__user=user))
    call_command("bootstrap_demo")
    replacement = capsys.readouterr().out.strip()
    assert replacement != first and _authenticate(f"Bearer {replacement}")[0] == user


def test_the_demo_bootstrap_refuses_in_production_mode(capsys, settings, tmp_path):
    settings.DEBUG = False
    settings.DATA_DIR = tmp_path
    with pytest.raises(CommandError, match="createsuperuser"):
        call_command("bootstrap_demo")
    assert not User.objects.filter(username="demo").exists() and not ApiKey.objects.exists()
    assert capsys.readouterr().out == "" and not list(tmp_path.iterdir())  # no key printed or kept


def test_an_organization_is_created_for_an_existing_owner(alice):
    call_command("create_organization", "Acme Research", owner="alice")
    organization = Organization.objects.get(memberships__user=alice)
    assert organization.name == "Acme Research" and organization.memberships.get().role == "owner"
    with pytest.raises(CommandError, match="No user named 'nobody'"):
        call_command("create_organization", "Globex", owner="nobody")
