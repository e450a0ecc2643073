"""A running job's heartbeat, sent from a thread of its own for as long as the job runs.

Steps are not the only slow thing a job does: loading the model, a validation pass, uploading a
checkpoint and publishing can each take longer than a step, and a job silent for
JOB_STALE_AFTER_SECONDS is given up on and queued again. So the beat does not wait for steps.

Each beat is conditional on the job still running this attempt (``finetuning.job_status.heartbeat``).
When one finds it does not (cancelled, or given up on and handed to another worker), ``lost`` is
set: the run stops at its next chance and writes nothing more.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from django.db import DatabaseError, connection

from finetuning import job_status

log = logging.getLogger(__name__)


class Heartbeat:
    def __init__(self, job_id: str, attempt: int, interval_s: float):
        self.job_id, self.attempt, self.interval_s = job_id, attempt, interval_s
        self.lost = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._beat_until_done, name=f"heartbeat {job_id}", daemon=True)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._done.set()
        self._thread.join()

    def beat(self, **fields: Any) -> bool:
        """Beat now, recording ``fields`` too; False once the job is lost to this attempt."""
        if self.lost.is_set():
            return False
        try:
            if not job_status.heartbeat(self.job_id, self.attempt, **fields):
                self.lost.set()
        except DatabaseError as exc:  # a database blip is not a lost job: the next beat tries again
            log.warning("job %s: heartbeat not written (%s); trying again", self.job_id, exc)
            connection.close()  # a broken connection stays broken: the next beat must open a new one
        return not self.lost.is_set()

    def _beat_until_done(self) -> None:
        try:
            while not self._done.wait(self.interval_s) and self.beat():
                pass
        finally:
            connection.close()  # this thread's own database connection
