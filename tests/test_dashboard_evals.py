"""The dashboard's evaluation pages through Django's test client: the evals list, an eval's runs and
answers side by side (words that differ marked), paging, live progress and cancel, and the models
page's Compare buttons, which start runs through ``evals.creation.start_runs`` (nothing is sent to
a worker here: rows and output items are made directly, no engine needed)."""

from __future__ import annotations

import re

import pytest
from django.urls import reverse

from core.word_diff import words_against
from evals import creation
from evals.models import Eval, EvalRun, OutputItem, RunStatus
from finetuning.models import FineTunedModel, ModelRevision
from tests.inference_fixtures import BASE, register_fine_tuned_model

pytestmark = pytest.mark.django_db

GRADERS = [{"type": "exact_match", "name": "exact"}, {"type": "contains", "name": "contains"}]
SAMPLING = {"max_completion_tokens": 16, "temperature": 0.0, "top_p": 1.0, "seed": None}


@pytest.fixture
def alice_web(client, alice):
    client.force_login(alice.user)
    return client


@pytest.fixture
def queued(monkeypatch) -> list[str]:
    """The runs sent to the default queue (no worker runs here), once their rows commit."""
    sent: list[str] = []
    monkeypatch.setattr("evals.creation.send_to_worker", sent.append)
    return sent


def an_eval(persona, name: str = "capitals", items: int = 3) -> Eval:
    return Eval.objects.create(
        organization=persona.organization, name=name, file_id="file-held-out", item_count=items, testing_criteria=GRADERS
    )


def a_run(evaluation: Eval, model: str, status: str = RunStatus.COMPLETED, **counts) -> EvalRun:
    return EvalRun.objects.create(
        eval=evaluation, organization=evaluation.organization, name=model, model=model, file_id=evaluation.file_id,
        sampling=SAMPLING, status=status, total_items=evaluation.item_count, **counts,
    )


def an_item(run: EvalRun, index: int, answer: str | None, expected: str = "Paris.", passed=(True, True)) -> OutputItem:
    results = [] if answer is None else [{"name": g["name"], "type": g["type"], "passed": p} for g, p in zip(GRADERS, passed)]
    status = "error" if answer is None else ("pass" if all(passed) else "fail")
    return OutputItem.objects.create(
        run=run, index=index, prompt=[{"role": "user", "content": f"Question {index}: the capital of France?"}],
        expected=expected, answer=answer, results=results, status=status,
        error_code="" if answer is not None else "invalid_request", error_message="" if answer is not None else "Too long.",
    )


def section(page: str, element_id: str) -> str:
    start = page.index(f'id="{element_id}"')
    return page[start : page.index("</section>", start)]


def cell(page: str, example: int, run: EvalRun) -> str:
    row = page[page.index(f'data-example="{example}"') :]
    row = row[: row.index("</tr>")]
    start = row.rindex("<td", 0, row.index(f'data-run="{run.id}"'))
    return row[start : row.index("</td>", start)]


def text_of(html: str) -> str:
    return re.sub(r"<[^>]+>", "", html)


def test_words_added_or_replaced_are_marked_and_shared_words_are_not():
    words = words_against("The capital is Rome, I think.", "The capital is Paris.")
    assert [(word.text, word.changed) for word in words] == [
        ("The", False), ("capital", False), ("is", False), ("Rome,", True), ("I", True), ("think.", True)
    ]
    assert "".join(word.space + word.text for word in words) == "The capital is Rome, I think."
    assert not any(word.changed for word in words_against("Paris.\nYes.", "Paris. Yes."))  # spacing is not a difference


def test_the_evals_page_lists_the_organizations_evals_from_the_navigation(alice_web, alice, charlie):
    evaluation = an_eval(alice)
    a_run(evaluation, BASE)
    an_eval(charlie, name="globex-secret")
    page = alice_web.get(reverse("dashboard:evals")).content.decode()
    assert f'href="{reverse("dashboard:evals")}">Evals</a>' in page
    assert f'href="{reverse("dashboard:eval", args=[evaluation.id])}">capitals</a>' in page
    assert "globex-secret" not in page


def test_another_organizations_eval_page_is_not_found(alice_web, charlie):
    assert alice_web.get(reverse("dashboard:eval", args=[an_eval(charlie).id])).status_code == 404


def test_an_eval_page_shows_each_run_with_its_progress_score_per_grader_and_pass_rate(alice_web, alice):
    evaluation = an_eval(alice, items=4)
    base = a_run(evaluation, BASE, done_items=4, passed_items=1, failed_items=3,
                 per_criteria={"exact": {"passed": 1, "failed": 3}, "contains": {"passed": 2, "failed": 2}})
    tuned = a_run(evaluation, f"{BASE}:capitals", RunStatus.IN_PROGRESS, done_items=2, passed_items=2,
                  per_criteria={"exact": {"passed": 2, "failed": 0}, "contains": {"passed": 2, "failed": 0}})
    runs = section(alice_web.get(reverse("dashboard:eval", args=[evaluation.id])).content.decode(), "runs")
    base_row, tuned_row = (runs[runs.index(f'data-run="{run.id}"') :].split("</tr>")[0] for run in (base, tuned))
    assert "Completed" in base_row and "4/4" in base_row
    assert re.findall(r'data-grader="(\w+)">([^<]+)<', base_row) == [("exact", "25%"), ("contains", "50%")]
    assert '<td class="pass-rate">25%</td>' in base_row
    assert "In Progress" in tuned_row and "2/4" in tuned_row and '<td class="pass-rate">100%</td>' in tuned_row
    assert runs.index(base.id) < runs.index(tuned.id)  # oldest first: the first is the one others are marked against


def test_each_example_shows_every_models_answer_with_its_verdicts_and_the_differing_words_marked(alice_web, alice):
    evaluation = an_eval(alice)
    base, tuned = a_run(evaluation, BASE), a_run(evaluation, f"{BASE}:capitals")
    an_item(base, 0, "I do not know.", passed=(False, False))
    an_item(tuned, 0, "I do know: Paris.", passed=(False, True))
    an_item(base, 1, "Paris.")
    an_item(tuned, 1, "Paris.")
    an_item(base, 2, None)  # no answer: the backend refused it
    page = alice_web.get(reverse("dashboard:eval", args=[evaluation.id])).content.decode()
    answers = section(page, "answers")
    assert "Question 0: the capital of France?" in answers and '<span class="role">expected</span> Paris.' in answers

    assert "<mark>" not in cell(page, 0, base)  # the first answer is what the others are marked against
    assert re.findall(r"<mark>([^<]+)</mark>", cell(page, 0, tuned)) == ["know:", "Paris."]
    verdicts = cell(page, 0, tuned)
    assert '<li class="fail" data-grader="exact">exact: fail</li>' in verdicts and '<li class="pass" data-grader="contains">contains: pass</li>' in verdicts
    assert 'class="answer differs"' in cell(page, 0, tuned) and 'class="answer"' in cell(page, 1, tuned)
    assert "<mark>" not in cell(page, 1, tuned)  # the same answer: nothing marked
    assert "No answer: Too long." in cell(page, 2, base) and "not scored yet" in cell(page, 2, tuned)


def test_examples_are_paged_with_every_runs_answers_on_each_page(alice_web, alice, monkeypatch):
    monkeypatch.setattr("dashboard.eval_pages.EXAMPLES_PER_PAGE", 2)
    evaluation = an_eval(alice, items=5)
    base, tuned = a_run(evaluation, BASE), a_run(evaluation, f"{BASE}:capitals")
    for index in range(5):
        an_item(base, index, "I do not know.")
        an_item(tuned, index, f"Answer {index}.")
    url = reverse("dashboard:eval", args=[evaluation.id])
    second = alice_web.get(url, {"page": 2}).content.decode()
    assert re.findall(r'data-example="(\d+)"', second) == ["2", "3"]
    assert "examples 3–4 of 5 scored" in second and 'rel="prev"' in second and 'rel="next"' in second
    assert "Answer 3." in text_of(cell(second, 3, tuned)) and "I do not know." in text_of(cell(second, 3, base))
    assert re.findall(r'data-example="(\d+)"', alice_web.get(url, {"page": "999"}).content.decode()) == ["4"]


def test_a_run_under_way_makes_the_page_look_again_and_offers_to_cancel_it(alice_web, alice):
    evaluation = an_eval(alice)
    running = a_run(evaluation, BASE, RunStatus.IN_PROGRESS)
    url = reverse("dashboard:eval", args=[evaluation.id])
    page = alice_web.get(url).content.decode()
    assert "location.reload()" in page and reverse("dashboard:eval_run_cancel", args=[evaluation.id, running.id]) in page

    running.status = RunStatus.COMPLETED
    running.save()
    finished = alice_web.get(url).content.decode()
    assert "location.reload()" not in finished and "eval_run_cancel" not in finished and "/cancel" not in finished


def test_canceling_a_run_from_the_page_stops_it_and_says_so(alice_web, alice):
    evaluation = an_eval(alice)
    running = a_run(evaluation, BASE, RunStatus.IN_PROGRESS)
    response = alice_web.post(reverse("dashboard:eval_run_cancel", args=[evaluation.id, running.id]), follow=True)
    running.refresh_from_db()
    assert running.status == RunStatus.CANCELED and running.finished_at is not None
    assert response.redirect_chain[-1][0] == reverse("dashboard:eval", args=[evaluation.id])
    assert "is canceled" in response.content.decode()

    again = alice_web.post(reverse("dashboard:eval_run_cancel", args=[evaluation.id, running.id]), follow=True)
    assert "already finished (canceled)" in again.content.decode()


def test_the_models_page_offers_each_fine_tune_the_compare_buttons_with_the_organizations_evals(alice_web, alice, charlie):
    model = register_fine_tuned_model(alice, "capitals")
    evaluation = an_eval(alice)
    an_eval(charlie, name="globex-secret")
    page = alice_web.get(reverse("dashboard:models")).content.decode()
    row = page[page.index(f'data-model="{model}"') :].split("</tr>")[0]
    assert f'<option value="{evaluation.id}">capitals</option>' in row and "globex-secret" not in page
    assert reverse("dashboard:model_compare_base", args=[model]) in row and "Compare with base" in row
    assert "Compare revisions" not in row  # one revision: nothing to compare it with
    ModelRevision.objects.create(model=FineTunedModel.objects.get(name=model), number=2)
    again = alice_web.get(reverse("dashboard:models")).content.decode()
    assert reverse("dashboard:model_compare_revisions", args=[model]) in again.split(f'data-model="{model}"')[1].split("</tr>")[0]


def test_compare_with_base_starts_runs_of_the_base_and_the_fine_tune_and_opens_the_eval_page(
    alice_web, alice, queued, django_capture_on_commit_callbacks
):
    model = register_fine_tuned_model(alice, "capitals")
    evaluation = an_eval(alice)
    with django_capture_on_commit_callbacks(execute=True):
        response = alice_web.post(reverse("dashboard:model_compare_base", args=[model]), {"eval": evaluation.id})
    assert response["Location"] == reverse("dashboard:eval", args=[evaluation.id])
    runs = list(EvalRun.objects.filter(eval=evaluation).order_by("created_at", "id"))
    assert [run.model for run in runs] == [BASE, model] and queued == [run.id for run in runs]
    assert {run.created_by for run in runs} == {alice.user} and {run.status for run in runs} == {RunStatus.QUEUED}


def test_compare_revisions_starts_a_run_per_revision_pinned_oldest_first(
    alice_web, alice, queued, django_capture_on_commit_callbacks
):
    model = register_fine_tuned_model(alice, "capitals")
    for number in (2, 3):
        ModelRevision.objects.create(model=FineTunedModel.objects.get(name=model), number=number)
    evaluation = an_eval(alice)
    with django_capture_on_commit_callbacks(execute=True):
        response = alice_web.post(reverse("dashboard:model_compare_revisions", args=[model]), {"eval": evaluation.id})
    assert response["Location"] == reverse("dashboard:eval", args=[evaluation.id])
    models = [run.model for run in EvalRun.objects.filter(eval=evaluation).order_by("created_at", "id")]
    assert models == [f"{model}@r1", f"{model}@r2", f"{model}@r3"] and len(queued) == 3


def test_a_comparison_the_api_would_refuse_shows_its_reason_and_starts_nothing(alice_web, alice, queued, monkeypatch):
    model = register_fine_tuned_model(alice, "capitals")
    evaluation = an_eval(alice)
    a_run(evaluation, BASE, RunStatus.IN_PROGRESS)
    monkeypatch.setattr(creation, "RUNS_AT_ONCE_PER_ORGANIZATION", 2)  # one under way, two more would pass it
    response = alice_web.post(reverse("dashboard:model_compare_base", args=[model]), {"eval": evaluation.id}, follow=True)
    assert response.redirect_chain[-1][0] == reverse("dashboard:models")
    assert "its limit of 2" in response.content.decode()
    assert EvalRun.objects.count() == 1 and queued == []

    one_revision = alice_web.post(reverse("dashboard:model_compare_revisions", args=[model]), {"eval": evaluation.id}, follow=True)
    assert "has one revision: there is nothing to compare it with" in one_revision.content.decode()
    assert EvalRun.objects.count() == 1 and queued == []


def test_a_comparison_on_an_eval_not_the_organizations_is_refused_and_starts_nothing(alice_web, alice, charlie, queued):
    model = register_fine_tuned_model(alice, "capitals")
    foreign = an_eval(charlie)
    response = alice_web.post(reverse("dashboard:model_compare_base", args=[model]), {"eval": foreign.id}, follow=True)
    assert "Choose one of your evals" in response.content.decode()
    assert not EvalRun.objects.exists() and queued == []
    assert alice_web.post(reverse("dashboard:model_compare_base", args=[f"{BASE}:nobody"]), {"eval": foreign.id}).status_code == 404


def test_a_runs_report_url_is_its_evals_page(alice, alice_web):
    evaluation = an_eval(alice)
    run = a_run(evaluation, BASE)
    answer = alice.api.get(f"/v1/evals/{evaluation.id}/runs/{run.id}").json()
    assert answer["report_url"] == f"http://testserver{reverse('dashboard:eval', args=[evaluation.id])}"
    assert alice_web.get(answer["report_url"].removeprefix("http://testserver")).status_code == 200
