"""Create the demo user, organization and API key (idempotent); print the key for the run command.

Development only: a user whose password is "demo" has no place on a deployed platform, so with
DEBUG=false the command refuses (bin/run then says how to create real users and keys).
"""

from __future__ import annotations

from pathlib import Path

from django.conf import settings
from django.contrib.auth.models import User
from django.core.management.base import BaseCommand, CommandError

from accounts.models import ApiKey, Organization, hash_key
from accounts.services import create_api_key, create_organization

DEMO_USERNAME = "demo"
DEMO_PASSWORD = "demo"


class Command(BaseCommand):
    help = "Create the demo user (password 'demo') with an API key, and print the key."

    def handle(self, *args: str, **options: object) -> None:
        if not settings.DEBUG:
            raise CommandError(
                "The demo user exists only in development (DEBUG=true). Create users with "
                "'manage.py createsuperuser' and 'manage.py create_organization', and API keys on the dashboard."
            )
        user, created = User.objects.get_or_create(username=DEMO_USERNAME)
        if created:
            user.set_password(DEMO_PASSWORD)
            user.save()
        organization = Organization.objects.filter(memberships__user=user).first()
        if organization is None:
            organization = create_organization("Demo", owner=user)
        # Only a key's hash is stored, so the demo key's secret is kept in the data folder to be
        # printed again at the next start (a real user's key is shown once).
        key_file: Path = settings.DATA_DIR / "demo-api-key"
        raw_key = key_file.read_text().strip() if key_file.exists() else ""
        if not ApiKey.objects.active().filter(hashed_key=hash_key(raw_key), organization=organization).exists():
            _, raw_key = create_api_key(organization, user, name="demo")
            key_file.write_text(raw_key + "\n")
            key_file.chmod(0o600)
        self.stdout.write(raw_key)
