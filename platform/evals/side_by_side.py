"""An eval's runs side by side, as the dashboard's eval page shows them: each run's summary (its
progress, a score per grader, its pass rate), and for a page of items each run's answer next to
the others, its words marked where they differ from the first answer given (the oldest run's, when
it has one), with each grader's result: pass or fail, a score with a bar, a judge's label and its
reasoning. Runs are compared by the item's place in their source (``OutputItem.index``)."""

from __future__ import annotations

from dataclasses import dataclass

from django.db.models import QuerySet

from core.word_diff import Word, words_against
from evals.models import Eval, EvalRun, OutputItem

MOST_RUNS_SIDE_BY_SIDE = 8  # columns a page can hold; the newest runs, oldest of them first


SCORED = ("text_similarity", "score_model", "multi")  # graders whose score is more than pass or fail


@dataclass(frozen=True)
class GraderScore:
    name: str
    share: float | None  # of the answered examples scored so far, those this grader passed; None: none yet
    mean: float | None = None  # a scored grader's mean score over them


@dataclass(frozen=True)
class ResultView:
    """One grader's result for one answer, as the page shows it."""

    name: str
    passed: bool
    score: float | None  # shown as a number, for graders whose score is more than pass or fail
    bar: float | None  # the score's place in its range, 0 to 1 (the bar's width)
    label: str | None  # a label_model's
    reasoning: str | None  # a judge's, when it gave one
    error: str | None


@dataclass(frozen=True)
class RunSummary:
    run: EvalRun
    grader_scores: list[GraderScore]  # in the eval's criteria order
    pass_rate: float | None  # of the examples scored so far, those every grader passed; None: none yet


@dataclass(frozen=True)
class Answer:
    run: EvalRun
    item: OutputItem | None  # None: the run has not scored this example (yet, or it stopped first)
    words: list[Word]  # the answer's words, marked against the first answer of the example
    differs: bool  # not word for word the first answer
    results: list[ResultView]


@dataclass(frozen=True)
class Example:
    index: int
    prompt: list[dict]  # the messages the first run's model answered ([] for samples given in advance)
    expected: str
    item: dict  # the data source's item (a chat file's: its input and expected answer)
    answers: list[Answer]  # one per run, in the runs' order


def runs_side_by_side(evaluation: Eval) -> list[EvalRun]:
    """The newest runs, oldest first: the first is the one the others' answers are marked against."""
    newest = list(evaluation.runs.order_by("-created_at", "-id")[:MOST_RUNS_SIDE_BY_SIDE])
    return newest[::-1]


def summaries(evaluation: Eval, runs: list[EvalRun]) -> list[RunSummary]:
    criteria = evaluation.testing_criteria
    return [
        RunSummary(run, [_grader_score(run, criterion) for criterion in criteria], _share(run.passed_items, run.done_items))
        for run in runs
    ]


def _grader_score(run: EvalRun, criterion: dict) -> GraderScore:
    counts = run.per_criteria.get(criterion["name"], {})
    passed, failed = counts.get("passed", 0), counts.get("failed", 0)
    mean = _share(counts.get("score_sum", 0.0), passed + failed) if criterion["type"] in SCORED else None
    return GraderScore(criterion["name"], _share(passed, passed + failed), mean)


def _share(part: float, whole: int) -> float | None:
    return part / whole if whole else None


def scored_indexes(runs: list[EvalRun]) -> QuerySet[OutputItem, int]:
    """Each example some run has scored, by its place in the file: what the page paginates."""
    return (
        OutputItem.objects.filter(run__in=runs).order_by("index").values_list("index", flat=True).distinct()
    )


def examples(evaluation: Eval, runs: list[EvalRun], indexes: list[int]) -> list[Example]:
    """The examples at ``indexes``, each with every run's answer (one query for them all)."""
    items = {(item.run_id, item.index): item for item in OutputItem.objects.filter(run__in=runs, index__in=indexes)}
    found = []
    for index in indexes:
        row = [items.get((run.pk, index)) for run in runs]
        first = next((item for item in row if item is not None), None)
        if first is None:  # its run was deleted since the page counted its examples
            continue
        reference = next((item.answer for item in row if item is not None and item.answer is not None), None)
        answers = [_answer(evaluation, run, item, reference) for run, item in zip(runs, row)]
        found.append(Example(index, first.prompt, first.expected, first.item, answers))
    return found


def _answer(evaluation: Eval, run: EvalRun, item: OutputItem | None, reference: str | None) -> Answer:
    if item is None or item.answer is None:
        return Answer(run, item, [], differs=False, results=[])
    words = words_against(item.answer, reference if reference is not None else item.answer)
    criteria = {criterion["name"]: criterion for criterion in evaluation.testing_criteria}
    results = [_result_view(result, criteria.get(result["name"], {})) for result in item.results]
    return Answer(run, item, words, differs=item.answer.split() != (reference or "").split(), results=results)


def _result_view(result: dict, criterion: dict) -> ResultView:
    said = result.get("sample") or {}
    scored = result.get("type") in SCORED
    score = float(result.get("score", 1.0 if result["passed"] else 0.0))
    low, high = criterion.get("range", [0.0, 1.0])  # a score_model's range; the others score 0 to 1
    bar = min(max((score - low) / (high - low), 0.0), 1.0) if scored and high > low else None
    return ResultView(
        result["name"], bool(result["passed"]), score if scored else None, bar, said.get("label"), said.get("reasoning"),
        said.get("error"),
    )
