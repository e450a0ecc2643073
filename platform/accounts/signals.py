"""``access_withdrawn``: a key, a membership or a user stopped being good for API access.

Whoever remembers a granted access (the gateway's grant cache) forgets it on this signal, so the
withdrawal holds from the next request in this process, not a cache lifetime later. Sent for a
revoked key, a deleted membership and a deactivated user (saved with ``is_active=False``); a bulk
``update()`` sends no model signal, so code that withdraws access that way sends this itself.
"""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.contrib.auth.base_user import AbstractBaseUser
from django.db.models.signals import post_delete, post_save
from django.dispatch import Signal

from accounts.models import Membership

access_withdrawn = Signal()


def _membership_deleted(sender: type[Membership], **kwargs: object) -> None:
    access_withdrawn.send(sender=Membership)


def _user_saved(sender: type[AbstractBaseUser], instance: AbstractBaseUser, **kwargs: object) -> None:
    if not instance.is_active:
        access_withdrawn.send(sender=sender)


def connect() -> None:
    post_delete.connect(_membership_deleted, sender=Membership, dispatch_uid="accounts.membership_deleted")
    post_save.connect(_user_saved, sender=get_user_model(), dispatch_uid="accounts.user_saved")
