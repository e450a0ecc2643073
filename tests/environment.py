"""Test-run environment, loaded as a plugin (``-p tests.environment``) before Django reads settings.

Tests use their own Redis database and ports, so a platform running on the same machine neither
steals their tasks nor answers their health checks. DATABASE_URL comes from the caller (the test
command runs the suite on PostgreSQL and on SQLite).

The test command runs the suite as two pytest processes at a time, its lanes (TEST_LANE; bin/test says
which tests each takes). Each lane has a Redis database, ports, storage, logs and a test database
(``tests.conftest.django_db_modify_db_settings``) of its own, so no lane takes another's tasks,
answers its health checks, nor overwrites the files of a row whose id another's database repeats.
"""

import os
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEST_DATA = ROOT / "data" / "test"


@dataclass(frozen=True)
class Lane:
    name: str
    redis_database: int
    first_port: int  # the pool listens here, its replicas from here + 100

    @property
    def data(self) -> Path:
        """Storage and logs: the slow lane (the whole suite, run on its own) keeps data/test itself."""
        return TEST_DATA if self.name == "slow" else TEST_DATA / self.name


# Redis databases in use: 0 is bin/run's; the other scenarios' brokers are 8 (test_healthz), 9
# (test_healthz, test_job_dispatch), 11 (test_worker_faults), 12 (test_across_hosts), 13 and 14 (the
# running product's). The late lane takes some of the slow lane's engine tests once the quick lane is done.
LANES = {lane.name: lane for lane in (Lane("slow", 15, 18100), Lane("quick", 10, 18300), Lane("late", 7, 18500))}
LANE = LANES.get(os.environ.get("TEST_LANE", "slow"))
if LANE is None:
    raise SystemExit(f"TEST_LANE={os.environ['TEST_LANE']!r}: use one of {', '.join(LANES)}")

# The suite tests the platform as bin/run starts it for local use, whatever the caller's shell says
# (production mode would redirect the test client's plain-http requests); tests of production mode
# set DEBUG=false themselves.
os.environ["DEBUG"] = "true"
os.environ.setdefault("REDIS_URL", f"redis://127.0.0.1:6379/{LANE.redis_database}")
os.environ.setdefault("DYNAMIC_LORA_PATH", str(LANE.data / "adapters"))
os.environ.setdefault("FILES_PATH", str(LANE.data / "files"))
os.environ.setdefault("INFERENCE_POOL_URL", f"http://127.0.0.1:{LANE.first_port}")
os.environ.setdefault("FIRST_REPLICA_PORT", str(LANE.first_port + 100))
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
):
    os.environ.setdefault(_limit, "1000000")
for _limit in ("TOKENS_PER_MINUTE_PER_KEY", "TOKENS_PER_MINUTE_PER_ORGANIZATION"):
    os.environ.setdefault(_limit, "1000000000")  # a request without max_tokens costs a whole context
# The tests' webhook receivers listen on 127.0.0.1 (plain http), for the worker processes too; the
# SSRF tests turn this off themselves.
os.environ.setdefault("WEBHOOKS_ALLOW_PRIVATE_ADDRESSES", "true")
# Hypothesis keeps its example database and caches here rather than in .hypothesis/ of the checkout.
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", str(TEST_DATA / "hypothesis"))
