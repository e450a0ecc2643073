"""OpenAI's ``fine_tuning.alpha.graders``: ``validate`` checks a grader without running it; ``run``
scores one sample with it, on a worker (``workers.grade_sample``), as every grading here is done:
a model grader's judge is asked there, through the answering path, never in the web process. The
web request waits for the worker's answer on a Redis list (asynchronously: no thread is held) for
at most RUN_WAIT_S, then answers 504.
"""

from __future__ import annotations

import json
import secrets

import redis.asyncio
from django.conf import settings
from kombu.exceptions import OperationalError

from accounts.models import Organization
from base.celery import GRADE_SAMPLE, send
from core.api_errors import UNAVAILABLE, ApiError
from evals.criteria import checked_with_judges

RUN_WAIT_S = 60  # a judge's answer on a busy engine takes seconds; a grader that needs more is not for run
REPLY_TTL_S = 120  # a reply nobody took (the caller gave up) is dropped
MAX_SAMPLE_CHARS = 100_000


def checked(organization: Organization, raw: object) -> dict:
    """The grader as it runs, or the 400 naming its field; a judge the organization may not use is its 404."""
    return checked_with_judges(organization, raw, "grader")


def reply_key(request_id: str) -> str:
    return f"graders:reply:{request_id}"


async def run_on_worker(organization_id: int, grader: dict, model_sample: str, item: object) -> dict:
    """The worker's outcome (``workers.grade_sample``: score, details, seconds, judge usage)."""
    if len(model_sample) > MAX_SAMPLE_CHARS:
        raise ApiError(f"model_sample is {len(model_sample):,} characters; at most {MAX_SAMPLE_CHARS:,}", param="model_sample")
    request_id = secrets.token_hex(12)
    payload = json.dumps({"grader": grader, "model_sample": model_sample, "item": item})
    client = redis.asyncio.Redis.from_url(settings.CONFIG.redis_url, socket_timeout=RUN_WAIT_S + 5)  # outlives the wait
    try:
        send(GRADE_SAMPLE, reply_key(request_id), str(organization_id), payload)
        reply = await client.blpop([reply_key(request_id)], timeout=RUN_WAIT_S)
    except (OperationalError, redis.RedisError):
        raise ApiError(
            "The grader could not be sent to a worker: the task broker is unreachable. Try again shortly.",
            status=503, type=UNAVAILABLE, code="broker_unavailable", retry_after_s=5,
        ) from None
    finally:
        await client.aclose()
    if reply is None:
        raise ApiError(
            f"The grader did not finish within {RUN_WAIT_S} s (a worker grades it: are the workers running and idle?). "
            "Try again, or grade in an eval run.", status=504, type=UNAVAILABLE, code="grader_timeout",
        )
    return dict(json.loads(reply[1]))


def run_response(grader: dict, outcome: dict) -> dict:
    """OpenAI's ``GraderRunResponse``."""
    details = outcome.get("details") or {}
    error = str(details.get("error") or "")
    judged = grader["type"] in ("score_model", "label_model")
    return {
        "reward": outcome["score"],
        "sub_rewards": details.get("sub_scores") or {},
        "model_grader_token_usage_per_model": outcome.get("judge_usage") or {},
        "metadata": {
            "name": grader.get("name") or grader["type"], "type": grader["type"],
            "execution_time": outcome["seconds"], "scores": {key: value for key, value in details.items() if key != "error"},
            "sampled_model_name": grader.get("model"), "token_usage": sum((outcome.get("judge_usage") or {}).values()) or None,
            "errors": {
                "formula_parse_error": False, "invalid_variable_error": False,
                "model_grader_parse_error": bool(error) and judged and "unavailable" not in error,
                "model_grader_refusal_error": False,
                "model_grader_server_error": bool(error) and judged and "unavailable" in error,
                "model_grader_server_error_details": error or None if judged else None,
                "other_error": bool(error) and not judged, "python_grader_runtime_error": False,
                "python_grader_runtime_error_details": None, "python_grader_server_error": False,
                "python_grader_server_error_type": None, "sample_parse_error": False,
                "truncated_observation_error": False, "unresponsive_reward_error": False,
            },
        },
    }
