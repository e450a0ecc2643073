"""What the suite costs, printed at the end of a run: the slowest test files (set-up, call and
tear-down of their tests together, so a module fixture that starts an engine counts where it is
used) and the test process's peak memory with the files it grew most in. The suite's budget
(`.ci/run`: 30 minutes, 16 GiB for the whole machine) is kept by looking at these, not by timed tests.
"""

from __future__ import annotations

import resource
from collections import defaultdict

import psutil
import pytest

from core.freed_memory import give_back_freed_memory

SLOWEST_FILES = 15

_seconds: dict[str, float] = defaultdict(float)
_growth: dict[str, int] = defaultdict(int)  # bytes of resident memory the test process gained


def _rss() -> int:
    return psutil.Process().memory_info().rss


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before = _rss()
    try:
        return (yield)
    finally:
        # What a test that trained freed goes back to the system (the heap would keep gigabytes for
        # the rest of the run), so the growth counted is what the test kept.
        give_back_freed_memory()
        _growth[item.location[0]] += max(0, _rss() - before)


def pytest_runtest_logreport(report) -> None:
    _seconds[report.location[0]] += report.duration


def pytest_terminal_summary(terminalreporter) -> None:
    if not _seconds:
        return
    write = terminalreporter.write_line
    terminalreporter.section("what the suite cost")
    write(f"the {SLOWEST_FILES} slowest test files (set-up + call + tear-down):")
    for path, seconds in sorted(_seconds.items(), key=lambda kv: -kv[1])[:SLOWEST_FILES]:
        write(f"  {seconds:7.1f} s  {path}")
    write(f"in all: {sum(_seconds.values()) / 60:.1f} min over {len(_seconds)} files")
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    write(f"the test process: peak resident memory {peak_gib:.2f} GiB; it grew most in:")
    for path, grown in sorted(_growth.items(), key=lambda kv: -kv[1])[:5]:
        write(f"  {grown / 2**20:7.0f} MiB  {path}")
