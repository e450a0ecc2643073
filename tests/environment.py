"""Test-run environment, loaded as a plugin (``-p tests.environment``) before Django reads settings.

Tests use their own Redis database and ports, so a platform running on the same machine neither
steals their tasks nor answers their health checks. DATABASE_URL comes from the caller (the test
command runs the suite on PostgreSQL and on SQLite).
"""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEST_DATA = ROOT / "data" / "test"

# The suite tests the platform as bin/run starts it for local use, whatever the caller's shell says
# (production mode would redirect the test client's plain-http requests); tests of production mode
# set DEBUG=false themselves.
os.environ["DEBUG"] = "true"
os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/15")
os.environ.setdefault("DYNAMIC_LORA_PATH", str(TEST_DATA / "adapters"))
os.environ.setdefault("INFERENCE_POOL_URL", "http://127.0.0.1:18100")
os.environ.setdefault("FIRST_REPLICA_PORT", "18200")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Heartbeats every second, so tests can give a job up after a few silent seconds.
os.environ.setdefault("JOB_HEARTBEAT_SECONDS", "1")
os.environ.setdefault("JOB_STALE_AFTER_SECONDS", "5")
# Tenant limits out of the way: organization ids repeat from test to test while Redis counters
# last their window (a minute, an hour), and processes the tests start read these too. Tests of
# the limits lower them (tests.limits).
for _limit in (
    "COMPLETIONS_PER_MINUTE_PER_KEY", "COMPLETIONS_PER_MINUTE_PER_ORGANIZATION", "UPLOADS_PER_HOUR_PER_ORGANIZATION",
    "SIGN_IN_FAILURES", "COMPOSITIONS_PER_HOUR_PER_ORGANIZATION",
):  # fmt: skip
    os.environ.setdefault(_limit, "1000000")
for _limit in ("TOKENS_PER_MINUTE_PER_KEY", "TOKENS_PER_MINUTE_PER_ORGANIZATION"):
    os.environ.setdefault(_limit, "1000000000")  # a request without max_tokens costs a whole context
# Hypothesis keeps its example database and caches here rather than in .hypothesis/ of the checkout.
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", str(TEST_DATA / "hypothesis"))
