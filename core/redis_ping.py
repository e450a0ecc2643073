"""Exit 0 when Redis answers at REDIS_URL: ``python -m core.redis_ping`` (used by the run command)."""

import sys

import redis

from core.config import load_config

if __name__ == "__main__":
    try:
        redis.Redis.from_url(load_config().redis_url, socket_timeout=1).ping()
    except redis.RedisError as exc:
        sys.exit(f"redis: {exc}")
