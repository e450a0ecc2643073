"""The trainer's database calls wait out an outage (``workers.db_retry``), for a while only."""

import dataclasses

import pytest
from django.db import OperationalError

from workers.db_retry import retrying


def failing(times: int):
    calls = []

    def call(value: str) -> str:
        calls.append(value)
        if len(calls) <= times:
            raise OperationalError("the connection is closed")
        return value

    return call, calls


def test_it_calls_again_until_the_database_answers():
    call, calls = failing(times=2)
    assert retrying(call, "written") == "written" and len(calls) == 3


def test_it_gives_up_after_job_database_wait_seconds(settings):
    settings.CONFIG = dataclasses.replace(settings.CONFIG, job_database_wait_s=0)
    call, calls = failing(times=1)
    with pytest.raises(OperationalError):
        retrying(call, "lost")
    assert len(calls) == 1


def test_it_leaves_other_errors_alone():
    def bug():
        raise ValueError("not an outage")

    with pytest.raises(ValueError):
        retrying(bug)
