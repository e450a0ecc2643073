"""What a member may do beyond using the organization: owners manage it (revoke anyone's API key,
delete fine-tuned models or roll them back, say whether members may do the same); members revoke
their own keys, and manage too only when an owner allows it (``Organization.members_may_manage``).
The API, the gateway and the dashboard all ask here."""

from __future__ import annotations

from django.contrib.auth.models import User
from django.core.exceptions import PermissionDenied

from accounts.models import ApiKey, Membership, Organization
from core.api_errors import ApiError


class ManagersOnly(ApiError, PermissionDenied):
    """Refused: only a manager may do this. An ``ApiError`` (403 ``permission_denied``) for the API
    and the gateway, and Django's ``PermissionDenied`` (its 403 page) for the dashboard."""

    def __str__(self) -> str:
        return self.message  # what the 403 page shows a person


def is_owner(organization: Organization, user: User) -> bool:
    return Membership.objects.filter(organization=organization, user=user, role=Membership.Role.OWNER).exists()


def may_manage(organization: Organization, user: User) -> bool:
    return organization.members_may_manage or is_owner(organization, user)


def check_may_manage_models(organization: Organization, user: User | None, doing: str) -> None:
    """Deleting a fine-tuned model, or changing the revision it answers with (what every member's
    requests get), is managing: ``doing`` names it ("delete", "roll back")."""
    if user is None or not may_manage(organization, user):
        raise ManagersOnly(
            f"Only an owner of {organization.name} can {doing} its models, unless an owner lets members do it "
            "(on the dashboard's API keys page).",
            status=403, param="model", code="permission_denied",
        )


def may_revoke(api_key: ApiKey, user: User) -> bool:
    return api_key.created_by_id == user.pk or may_manage(api_key.organization, user)


def allow_members_to_manage(organization: Organization, user: User, allowed: bool) -> None:
    if not is_owner(organization, user):
        raise PermissionDenied("Only an owner of the organization can change what members may do.")
    Organization.objects.filter(pk=organization.pk).update(members_may_manage=allowed)
    organization.members_may_manage = allowed
