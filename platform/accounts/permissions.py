"""What a member may do beyond using the organization: owners manage it (revoke anyone's API key,
delete fine-tuned models, say whether members may do the same); members revoke their own keys, and
manage too only when an owner allows it (``Organization.members_may_manage``). The API, the gateway
and the dashboard all ask here."""

from __future__ import annotations

from django.contrib.auth.models import User
from django.core.exceptions import PermissionDenied

from accounts.models import ApiKey, Membership, Organization


def is_owner(organization: Organization, user: User) -> bool:
    return Membership.objects.filter(organization=organization, user=user, role=Membership.Role.OWNER).exists()


def may_manage(organization: Organization, user: User) -> bool:
    return organization.members_may_manage or is_owner(organization, user)


def may_revoke(api_key: ApiKey, user: User) -> bool:
    return api_key.created_by_id == user.pk or may_manage(api_key.organization, user)


def allow_members_to_manage(organization: Organization, user: User, allowed: bool) -> None:
    if not is_owner(organization, user):
        raise PermissionDenied("Only an owner of the organization can change what members may do.")
    Organization.objects.filter(pk=organization.pk).update(members_may_manage=allowed)
    organization.members_may_manage = allowed
