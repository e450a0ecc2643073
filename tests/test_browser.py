"""A data scientist's whole path through the dashboard, in real headless Chromium.

Screenshots of each page land in test-artifacts/screenshots/ for a person to look at.
"""

import re

import pytest

from accounts.models import ApiKey
from tests.browser import screenshot
from tests.personas import good_dataset

pytestmark = [pytest.mark.training, pytest.mark.django_db(transaction=True)]
pytest_plugins = ["tests.browser"]

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"


def sign_in(page, live_server, persona):
    page.goto(f"{live_server.url}/login")
    page.fill("#id_username", persona.user.username)
    page.fill("#id_password", "pw")
    page.click("button[type=submit]")
    page.wait_for_url(re.compile(r"/jobs$"))


def test_a_data_scientist_uploads_trains_watches_and_manages_keys(page, live_server, alice, celery_worker, tmp_path):
    sign_in(page, live_server, alice)
    screenshot(page, "01-jobs-empty")

    lines = good_dataset(12).decode().splitlines()
    lines[3] = '{"messages": [{"role": "user", "content": "hi"}]}'
    (tmp_path / "broken.jsonl").write_text("\n".join(lines))
    page.goto(f"{live_server.url}/datasets")
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

    page.goto(f"{live_server.url}/models")
    assert f"{BASE}:pirate" in page.inner_text("table.list")
    screenshot(page, "07-models")

    page.goto(f"{live_server.url}/keys")
    page.fill("#id_name", "notebook")
    page.click("form:not(.inline) button[type=submit]")
    page.wait_for_selector("#new-key-value")
    screenshot(page, "08-new-key")
    page.on("dialog", lambda dialog: dialog.accept())  # "Revoke notebook?"
    page.click("tr:has-text('notebook') button:has-text('Revoke')")
    page.wait_for_selector("tr:has-text('notebook') >> text=revoked")
    assert not ApiKey.objects.get(name="notebook").is_active
    screenshot(page, "09-key-revoked")


def test_the_dashboard_fits_a_phone_screen(browser, live_server, alice):
    context = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True)
    page = context.new_page()
    sign_in(page, live_server, alice)
    page.goto(f"{live_server.url}/datasets")
    overflow = page.evaluate("document.documentElement.scrollWidth - document.documentElement.clientWidth")
    screenshot(page, "10-phone-datasets")
    context.close()
    assert overflow <= 0
