"""A data scientist's whole path through the dashboard, in real headless Chromium.

The path runs against the real web process (Django under uvicorn, as ``bin/run`` serves it) in
front of the real pool, so the playground's answer streams as it would for a user. Screenshots of
each page land in test-artifacts/screenshots/ for a person to look at.
"""

# ruff: noqa: F811 (pytest fixtures are imported from tests.inference_fixtures, then named as arguments)
import dataclasses
import re

import pytest

from accounts.models import ApiKey
from finetuning.models import File, FineTuningJob
from tests.browser import screenshot
from tests.inference_fixtures import adapter_store, gateway, make_adapter  # noqa: F401 (fixtures)
from tests.personas import good_dataset, preference_dataset

pytestmark = pytest.mark.django_db(transaction=True)

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"


def sign_in(page, site: str, persona):
    page.goto(f"{site}/login")
    page.fill("#id_username", persona.user.username)
    page.fill("#id_password", "pw")
    page.click("button[type=submit]")
    page.wait_for_url(re.compile(r"/jobs$"))


@pytest.mark.training
@pytest.mark.engine
def test_a_data_scientist_uploads_trains_watches_chats_and_manages_keys(page, gateway, alice, celery_worker, tmp_path):
    site = gateway
    sign_in(page, site, alice)
    screenshot(page, "01-jobs-empty")

    lines = good_dataset(12).decode().splitlines()
    lines[3] = '{"messages": [{"role": "user", "content": "hi"}]}'
    (tmp_path / "broken.jsonl").write_text("\n".join(lines))
    page.goto(f"{site}/datasets")
    page.set_input_files("#id_file", str(tmp_path / "broken.jsonl"))
    page.click("#upload-form button[type=submit]")
    page.wait_for_selector(".line-errors")
    assert "line 4" in page.inner_text(".line-errors")
    screenshot(page, "02-dataset-error")

    (tmp_path / "pirate.jsonl").write_bytes(good_dataset(12))
    page.set_input_files("#id_file", str(tmp_path / "pirate.jsonl"))
    page.click("#upload-form button[type=submit]")
    page.wait_for_selector(".conversation")
    assert "12 examples" in page.inner_text(".meta")
    screenshot(page, "03-dataset-preview")

    page.click("text=Fine-tune on it")
    page.fill("#id_suffix", "pirate")
    page.fill("#id_n_epochs", "3")
    page.fill("#id_batch_size", "4")
    assert "training tokens" in page.inner_text("#estimate")
    screenshot(page, "04-new-fine-tune")
    page.click("#job-form button[type=submit]")
    page.wait_for_url(re.compile(r"/jobs/ftjob-"))

    # The loss chart grows while the job runs, then the model name and snippets appear.
    page.wait_for_function("Number(document.getElementById('loss-chart').dataset.points || 0) >= 2", timeout=240_000)
    screenshot(page, "05-job-training")
    page.wait_for_selector("#status.succeeded", timeout=240_000)
    assert page.inner_text("#model-name") == f"{BASE}:pirate"
    assert f"{BASE}:pirate" in page.inner_text("#python-snippet")
    assert int(page.eval_on_selector("#loss-chart", "svg => svg.dataset.points")) == 9
    screenshot(page, "06-job-succeeded")

    # The playground: the fine-tuned model's answer streams in, then both models answer side by side.
    page.click("#playground-link")
    page.wait_for_selector("#pane-2:not([hidden])")
    page.uncheck("#compare")
    page.fill("#temperature", "0")  # the same answers every run, for the screenshots
    page.fill("#max-tokens", "48")
    page.fill("#prompt", "What is 3 plus 4?")
    page.click("#send")
    page.wait_for_selector("#pane-1 .bubble.assistant.done", timeout=60_000)
    streamed = page.eval_on_selector("#pane-1 .bubble.assistant", "node => Number(node.dataset.chunks)")
    assert streamed >= 2, "the answer arrived in one piece, not streamed"
    assert page.inner_text("#pane-1 .bubble.assistant .text").strip()
    assert "tokens/s" in page.inner_text("#pane-1 .pane-stats")
    screenshot(page, "07-playground")
    page.check("#compare")
    page.click("#clear")
    page.fill("#prompt", "Say hello.")
    page.click("#send")
    page.wait_for_selector("#pane-2 .bubble.assistant.done", timeout=60_000)
    page.wait_for_selector("#pane-1 .bubble.assistant.done", timeout=60_000)
    assert page.input_value("#pane-1 .model") == f"{BASE}:pirate" and page.input_value("#pane-2 .model") == BASE
    screenshot(page, "08-playground-compare")

    page.goto(f"{site}/models")
    pirate = page.locator(f"tr[data-model='{BASE}:pirate']")
    assert "loaded on 1 replica" in pirate.inner_text()  # the playground's requests loaded it
    screenshot(page, "09-models")

    page.goto(f"{site}/keys")
    page.fill("#id_name", "notebook")
    page.click("form:not(.inline) button[type=submit]")
    page.wait_for_selector("#new-key-value")
    screenshot(page, "10-new-key")
    page.on("dialog", lambda dialog: dialog.accept())  # "Revoke notebook?"
    page.click("tr:has-text('notebook') button:has-text('Revoke')")
    page.wait_for_selector("tr:has-text('notebook') >> text=revoked")
    assert not ApiKey.objects.get(name="notebook").is_active
    screenshot(page, "11-key-revoked")


def test_the_dashboard_fits_a_phone_screen(browser, live_server, alice):
    context = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True)
    page = context.new_page()
    sign_in(page, live_server.url, alice)
    overflows = {}
    for name in ("datasets", "playground"):
        page.goto(f"{live_server.url}/{name}")
        overflows[name] = page.evaluate("document.documentElement.scrollWidth - document.documentElement.clientWidth")
        screenshot(page, f"12-phone-{name}")
    context.close()
    assert all(overflow <= 0 for overflow in overflows.values()), overflows


def test_a_file_over_the_upload_cap_is_refused_on_the_page_before_it_is_sent(page, live_server, alice, settings, tmp_path):
    from base.upload_limits import file_too_large_message

    small = good_dataset(12)
    settings.CONFIG = dataclasses.replace(settings.CONFIG, max_upload_bytes=len(small) + 100)
    sign_in(page, live_server.url, alice)
    page.goto(f"{live_server.url}/datasets")
    posts: list[str] = []
    page.on("request", lambda request: request.method == "POST" and posts.append(request.url))

    (tmp_path / "large.jsonl").write_bytes(good_dataset(200))
    page.set_input_files("#id_file", str(tmp_path / "large.jsonl"))
    assert page.inner_text("#id_file-too-large") == file_too_large_message()
    page.click("#upload-form button[type=submit]")
    page.wait_for_timeout(500)  # time for a request to start, had the form been sent
    screenshot(page, "13-upload-too-large")
    assert posts == [] and not File.objects.exists()

    (tmp_path / "small.jsonl").write_bytes(small)  # another choice clears the refusal, and is sent
    page.set_input_files("#id_file", str(tmp_path / "small.jsonl"))
    assert not page.is_visible("#id_file-too-large")
    page.click("#upload-form button[type=submit]")
    page.wait_for_selector(".conversation")
    assert len(posts) == 1 and File.objects.count() == 1


def test_an_adapter_uploaded_on_its_form_is_listed_and_downloads_under_its_name(
    page, live_server, alice, make_adapter, settings, tmp_path
):
    from tests.adapter_archives import adapter_files, tar_gz

    settings.INFERENCE_POOL_URL = "http://127.0.0.1:9"  # which models are loaded does not matter here
    name = f"{BASE}:browser-upload"
    adapter_store().delete(name)  # the dynamic path outlives the test database
    sign_in(page, live_server.url, alice)
    page.goto(f"{live_server.url}/models")
    page.click("#adapter-upload >> text=Upload an adapter")
    page.wait_for_url(re.compile(r"/models/upload$"))

    (tmp_path / "broken.tar.gz").write_bytes(b"just some bytes")
    page.set_input_files("#id_adapter-file", str(tmp_path / "broken.tar.gz"))
    page.fill("#id_adapter-suffix", "browser-upload")
    page.click("#adapter-upload-form button[type=submit]")
    page.wait_for_selector("#field-file .field-error:not([hidden])")  # not the size check's hidden one
    assert "not a readable .tar.gz or .zip" in page.inner_text("#field-file")
    screenshot(page, "14-adapter-upload-refused")

    (tmp_path / "adapter.tar.gz").write_bytes(tar_gz(adapter_files(make_adapter(seed=13))))
    page.set_input_files("#id_adapter-file", str(tmp_path / "adapter.tar.gz"))
    page.click("#adapter-upload-form button[type=submit]")  # the suffix is still filled in
    page.wait_for_url(re.compile(r"/models$"))
    row = page.locator(f"tr[data-model='{name}']")
    assert "uploaded adapter" in row.inner_text()
    screenshot(page, "15-adapter-uploaded")
    try:
        with page.expect_download() as download:
            row.locator("text=Download adapter").click()
        assert download.value.suggested_filename == "HuggingFaceTB--SmolLM2-135M-Instruct--browser-upload.tar.gz"
    finally:
        adapter_store().delete(name)


def test_a_model_composed_on_its_form_is_listed_with_its_parents(page, live_server, alice, make_adapter, settings):
    from tests.inference_fixtures import publish_fine_tuned_model as published

    settings.INFERENCE_POOL_URL = "http://127.0.0.1:9"  # which models are loaded does not matter here
    left, right, name = f"{BASE}:browser-left", f"{BASE}:browser-right", f"{BASE}:browser-blend"
    for model in (left, right, name):
        adapter_store().delete(model)  # the dynamic path outlives the test database
    try:
        published(alice, "browser-left", make_adapter(seed=21))
        published(alice, "browser-right", make_adapter(seed=22))
        sign_in(page, live_server.url, alice)
        page.goto(f"{live_server.url}/models")
        page.click("#model-compose >> text=Compose a model")
        page.wait_for_url(re.compile(r"/models/compose$"))
        for model, scale in ((left, "0.7"), (right, "0.3")):
            row = page.locator(f"tr[data-parent='{model}']")
            row.locator("input[type=checkbox]").check()
            row.locator("input[type=number]").fill(scale)
        page.fill("#id_compose-suffix", "browser-blend")
        screenshot(page, "16-compose-form")
        page.click("#compose-form button[type=submit]")
        page.wait_for_url(re.compile(r"/models$"))
        assert f"{name} is published (approximation error 0)" in page.inner_text(".flash.success")
        lineage = page.locator(f"tr[data-model='{name}'] td.lineage").inner_text()
        assert "composed of" in lineage and f"{left} × 0.7" in lineage and f"{right} × 0.3" in lineage
        assert "linear, LoRA r 16" in lineage
        screenshot(page, "17-composed-lineage")
    finally:
        for model in (left, right, name):
            adapter_store().delete(model)


def test_a_dpo_fine_tune_is_started_on_the_form_from_uploaded_preference_pairs(page, live_server, alice, tmp_path):
    sign_in(page, live_server.url, alice)
    page.goto(f"{live_server.url}/datasets")
    (tmp_path / "pairs.jsonl").write_bytes(preference_dataset(12))
    page.set_input_files("#id_file", str(tmp_path / "pairs.jsonl"))
    page.click("#upload-form button[type=submit]")
    page.wait_for_selector(".conversation")

    page.goto(f"{live_server.url}/jobs/new")
    page.select_option("#id_method", "dpo")
    pairs = File.objects.get()
    page.select_option("#id_training_file", label=f"pairs.jsonl (12 preference pairs, {pairs.token_count} tokens)")
    page.fill("#id_beta", "0.25")
    page.fill("#id_suffix", "prefers")
    screenshot(page, "15-dpo-form")
    page.click("#job-form button[type=submit]")
    page.wait_for_url(re.compile(r"/jobs/ftjob-"))
    assert page.inner_text("#method") == "DPO, beta 0.25"
    job = FineTuningJob.objects.get()
    assert (job.method, job.suffix, job.hyperparameters["beta"]) == ("dpo", "prefers", 0.25)


def test_the_job_page_marks_the_best_checkpoint_early_stopping_published_on_the_loss_chart(page, live_server, alice):
    from finetuning.models import Checkpoint, FineTuningJob, JobStatus, record_event

    job = FineTuningJob.objects.create(
        organization=alice.organization, model=BASE, training_file="file-x", validation_file="file-y", suffix="early",
        seed=0, hyperparameters={"n_epochs": 2, "early_stopping": {"patience": 2, "min_delta": 0.0}},
        status=JobStatus.SUCCEEDED, fine_tuned_model=f"{BASE}:early", best_step=2,
    )
    for step, valid_loss in ((1, 1.2), (2, 0.9), (3, 1.1), (4, 1.3)):  # the validation loss turns up after step 2
        metrics = {"step": step, "total_steps": 8, "epoch": 1, "train_loss": 1.0 / step, "valid_loss": valid_loss,
                   "tokens_per_second": 50.0, "trained_tokens": 100 * step}
        record_event(job, f"Step {step}/8", data=metrics)
        Checkpoint.objects.create(job=job, step_number=step, epoch=1, metrics=metrics, storage_key=f"ckpt/{step}")
    sign_in(page, live_server.url, alice)
    page.goto(f"{live_server.url}/jobs/{job.id}")
    page.wait_for_function("document.getElementById('loss-chart').dataset.points === '4'")
    screenshot(page, "14-job-early-stopping")
    assert page.eval_on_selector("#loss-chart", "svg => svg.dataset.best") == "2"
    assert page.text_content("#loss-chart text.best") == "best: step 2, published"
    assert page.eval_on_selector_all("#checkpoints tr.best td:first-child", "cells => cells.map(c => c.innerText)") == [
        "2 best, published"
    ]


def test_the_eval_page_puts_two_models_answers_side_by_side_with_the_difference_highlighted(
    page, live_server, alice, settings, monkeypatch
):
    from evals.models import Eval, EvalRun, OutputItem, RunStatus
    from tests.inference_fixtures import register_fine_tuned_model

    settings.INFERENCE_POOL_URL = "http://127.0.0.1:9"  # which models are loaded does not matter here
    monkeypatch.setattr("evals.creation.send_to_worker", lambda run_id: None)  # the runs are scored below, by hand
    model = register_fine_tuned_model(alice, "capitals")
    evaluation = Eval.objects.create(
        organization=alice.organization, name="capitals", file_id="file-held-out", item_count=2,
        testing_criteria=[{"type": "contains", "name": "contains"}],
    )
    sign_in(page, live_server.url, alice)
    page.goto(f"{live_server.url}/models")
    row = page.locator(f"tr[data-model='{model}']")
    row.locator("select[name=eval]").select_option(evaluation.id)
    row.locator("button:has-text('Compare with base')").click()
    page.wait_for_url(re.compile(rf"/evals/{evaluation.id}$"))
    assert "Started 2 runs of capitals" in page.inner_text(".flash.success")
    assert page.inner_text("#live")  # queued: the page looks again until they have finished

    base, tuned = EvalRun.objects.filter(eval=evaluation).order_by("created_at", "id")
    for run, answers in ((base, ["I do not know.", "Berlin."]), (tuned, ["The capital is Paris.", "Berlin."])):
        for index, (answer, expected) in enumerate(zip(answers, ["Paris.", "Berlin."])):
            passed = expected in answer
            OutputItem.objects.create(
                run=run, index=index, prompt=[{"role": "user", "content": f"Capital number {index}?"}], expected=expected,
                answer=answer, results=[{"name": "contains", "type": "contains", "passed": passed}],
                status="pass" if passed else "fail",
            )
        passed = sum(expected in answer for answer, expected in zip(answers, ["Paris.", "Berlin."]))
        EvalRun.objects.filter(pk=run.pk).update(
            status=RunStatus.COMPLETED, done_items=2, passed_items=passed, failed_items=2 - passed,
            per_criteria={"contains": {"passed": passed, "failed": 2 - passed}},
        )
    page.goto(f"{live_server.url}/evals")
    page.click(f"tr[data-eval='{evaluation.id}'] a")
    page.wait_for_selector("#answers")
    assert page.locator("#live").count() == 0  # all finished: no more reloading
    assert page.inner_text(f"#runs tr[data-run='{base.id}'] .pass-rate") == "50%"
    assert page.inner_text(f"#runs tr[data-run='{tuned.id}'] .pass-rate") == "100%"

    first, second = (page.locator(f"#answers tr[data-example='{index}']") for index in (0, 1))
    assert first.locator(f"td[data-run='{base.id}'] .answer-text").inner_text() == "I do not know."
    assert first.locator(f"td[data-run='{tuned.id}'] .answer-text").inner_text() == "The capital is Paris."
    marked = first.locator(f"td[data-run='{tuned.id}'] mark")
    assert marked.all_inner_texts() == ["The", "capital", "is", "Paris."]
    background = marked.first.evaluate("node => getComputedStyle(node).backgroundColor")
    assert background not in ("rgba(0, 0, 0, 0)", "transparent")  # highlighted, not just tagged
    assert first.locator(f"td[data-run='{tuned.id}'] .verdicts .pass").inner_text() == "contains: pass"
    assert second.locator("mark").count() == 0  # the same answer in both: nothing highlighted
    screenshot(page, "18-eval-side-by-side")
