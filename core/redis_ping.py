"""Whether Redis answers: for /healthz, and ``python -m core.redis_ping`` (exit 0 when Redis answers
at REDIS_URL) for the run and test commands."""

import sys

import redis

from core.config import load_config


def redis_problem(url: str, timeout_s: float = 1.0) -> str | None:
    """None when Redis answers at ``url``, else what went wrong."""
    try:
        redis.Redis.from_url(url, socket_timeout=timeout_s).ping()
    except redis.RedisError as exc:
        return f"redis: {exc}"
    return None


if __name__ == "__main__":
    problem = redis_problem(load_config().redis_url)
    if problem:
        sys.exit(problem)
