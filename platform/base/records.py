"""What every app's records share: OpenAI-shaped ids, querysets scoped to an organization, and the
unix timestamps their API objects carry."""

from __future__ import annotations

import secrets
import string
from datetime import datetime
from typing import Self

from django.db import models

_ID_ALPHABET = string.ascii_letters + string.digits


def new_id(prefix: str, separator: str = "-") -> str:
    """OpenAI-shaped object ids: a type prefix and 24 random characters (``ftjob-abc...``; with
    ``separator`` "_" as OpenAI's newer objects have them, ``evt_abc...``)."""
    return prefix + separator + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


class OrgQuerySet(models.QuerySet):
    """Rows of one organization: another's answer 404, as if they did not exist."""

    def for_org(self, organization: models.Model) -> Self:
        return self.filter(organization=organization)


def unix(moment: datetime | None) -> int | None:
    return int(moment.timestamp()) if moment else None
