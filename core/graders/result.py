"""What grading one sample gives: its own module so that ``judging`` (which reads a judge's verdict
into one) and ``engine`` (which makes the rest) share it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Result:
    """``score``: the reward (string_check 1.0 or 0.0, text_similarity the metric, score_model the
    judge's result, label_model 1.0 for a passing label, multi the formula's value). ``passed``:
    against a pass_threshold where one applies (label_model: the label is a passing one;
    string_check: the score is 1), None where none does. ``details``: what a person reads, as
    applicable: ``label``, ``reasoning``, ``sub_scores`` (a multi grader's, by name), ``error``."""

    score: float
    passed: bool | None
    details: dict = field(default_factory=dict)

    @property
    def error(self) -> str | None:
        return self.details.get("error")


def error_result(message: str, **details: object) -> Result:
    """A sample that could not be graded: score 0, not passed (``engine.grade`` sets ``passed`` to
    None where no threshold applies), and why."""
    return Result(0.0, False, {**details, "error": message})
