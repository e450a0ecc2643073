"""``graders.run`` on a worker: one sample graded by one grader (``workers.scoring.Grading``, as eval
runs grade), the outcome pushed onto the Redis list its web request waits on (``evals.grader_runs``)."""

from __future__ import annotations

import json
import time

import redis
from django.conf import settings

from answering.batch import Answerer
from core.eval_items import EvalItem
from core.graders.engine import sample_of
from core.grading import GradingSandbox
from evals.grader_runs import REPLY_TTL_S
from workers.scoring import Grading


def grade_sample(reply_to: str, organization_id: int, payload: str) -> str:
    request = json.loads(payload)
    item = request["item"] if isinstance(request["item"], dict) else {}
    started = time.monotonic()
    with Answerer(organization_id) as answerer, GradingSandbox() as sandbox:
        grading = Grading(answerer, sandbox)
        result = grading.result(request["grader"], EvalItem(item), sample_of(request["model_sample"]))
    outcome = {
        "score": result.score, "details": result.details, "seconds": round(time.monotonic() - started, 3),
        "judge_usage": dict(grading.judge_tokens),
    }
    client = redis.Redis.from_url(settings.CONFIG.redis_url)
    with client.pipeline() as pipeline:  # the reply and its expiry at once: a reply nobody takes goes away
        pipeline.rpush(reply_to, json.dumps(outcome))
        pipeline.expire(reply_to, REPLY_TTL_S)
        pipeline.execute()
    return f"graded: {result.score:g}"
