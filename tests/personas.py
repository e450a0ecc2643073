"""Fixed people for API tests: alice owns Acme, bob is her teammate, charlie is an outsider."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
from django.contrib.auth.models import User
from rest_framework.test import APIClient

from accounts.models import Membership, Organization
from accounts.services import create_api_key, create_organization


@dataclass
class Persona:
    user: User
    organization: Organization
    key: str
    api: APIClient


def _persona(username: str, organization: Organization | None = None, org_name: str = "") -> Persona:
    user = User.objects.create_user(username, password="pw")
    if organization is None:
        organization = create_organization(org_name, owner=user)
    else:
        Membership.objects.create(user=user, organization=organization)
    _, key = create_api_key(organization, user, f"{username}'s key")
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    return Persona(user, organization, key, api)


@pytest.fixture
def alice() -> Persona:
    return _persona("alice", org_name="Acme")


@pytest.fixture
def bob(alice) -> Persona:
    return _persona("bob", organization=alice.organization)


@pytest.fixture
def charlie() -> Persona:
    return _persona("charlie", org_name="Globex")


def chat_example(question: str, answer: str, **assistant_extra) -> dict:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer, **assistant_extra}]}


def jsonl(records: list) -> bytes:
    return "".join(json.dumps(record) + "\n" for record in records).encode()


def good_dataset(n: int = 12) -> bytes:
    return jsonl([chat_example(f"What is {i} plus {i}?", f"ARR! {2 * i}, matey.") for i in range(n)])


def batch_lines(n: int = 2) -> bytes:
    """A Batch API input file of ``n`` chat requests of the test catalog's base model."""
    body = {"model": "HuggingFaceTB/SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    return jsonl([{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body} for i in range(n)])


def preference_example(question: str, preferred: str, non_preferred: str) -> dict:
    return {
        "input": {"messages": [{"role": "user", "content": question}]},
        "preferred_output": [{"role": "assistant", "content": preferred}],
        "non_preferred_output": [{"role": "assistant", "content": non_preferred}],
    }


def prompts_dataset(n: int = 12) -> bytes:
    """Prompts with the field a grader reads, for reinforcement jobs (OpenAI's RFT lines)."""
    return jsonl([{"messages": [{"role": "user", "content": f"What is {i} plus {i}?"}], "reference_answer": str(2 * i)}
                  for i in range(n)])


def preference_dataset(n: int = 12) -> bytes:
    """Pairs whose preferred answer talks like a pirate, for DPO jobs."""
    return jsonl([preference_example(f"What is {i} plus {i}?", f"ARR! {2 * i}, matey.", f"{2 * i}.") for i in range(n)])
