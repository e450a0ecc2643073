"""Create an organization owned by an existing user: how a deployment (no demo user) starts.

The owner then signs in to the dashboard and creates the organization's API keys there.
"""

from __future__ import annotations

from django.contrib.auth.models import User
from django.core.management.base import BaseCommand, CommandError, CommandParser

from accounts.services import create_organization


class Command(BaseCommand):
    help = "Create an organization with OWNER (a user, e.g. from createsuperuser) as its owner."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="the organization's name, e.g. 'Acme'")
        parser.add_argument("--owner", required=True, help="the username of its owner")

    def handle(self, *args: str, name: str, owner: str, **options: object) -> None:
        user = User.objects.filter(username=owner).first()
        if user is None:
            raise CommandError(f"No user named {owner!r}: create one first with 'manage.py createsuperuser'.")
        organization = create_organization(name, owner=user)
        self.stdout.write(f"Created organization {organization.name!r} owned by {user.username}.")
