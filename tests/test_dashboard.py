"""Dashboard pages through Django's test client: each person sees only their organization's things."""

import dataclasses
import io
import json

import pytest
from django.urls import reverse

from accounts.models import ApiKey
from accounts.services import create_api_key
from finetuning.models import File, FineTunedModel, FineTuningJob
from tests.inference_fixtures import register_fine_tuned_model
from tests.limits import lower_limits, own_counters  # noqa: F401 (a fixture)
from tests.personas import good_dataset, preference_dataset, prompts_dataset
from tests.tool_calling import WEATHER_TOOL, weather_dataset

pytestmark = pytest.mark.django_db

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"


def signed_in(client, persona):
    client.force_login(persona.user)
    return client


def upload(client, data: bytes, name: str = "train.jsonl"):
    handle = io.BytesIO(data)
    handle.name = name
    return client.post(reverse("dashboard:datasets"), {"file": handle})


@pytest.fixture
def alice_web(client, alice):
    return signed_in(client, alice)


def test_pages_ask_to_sign_in_first(client):
    response = client.get(reverse("dashboard:jobs"))
    assert response.status_code == 302 and response["Location"].startswith(reverse("dashboard:login"))


def test_a_dataset_upload_shows_line_numbered_errors_and_stores_nothing(alice_web):
    lines = good_dataset(12).decode().splitlines()
    lines[6] = '{"messages": [{"role": "narrator", "content": "x"}]}'
    page = upload(alice_web, "\n".join(lines).encode()).content.decode()
    assert "line 7" in page and "messages[0].role must be one of system, user, assistant" in page
    assert not File.objects.exists()


def test_a_good_dataset_is_previewed_as_a_conversation(alice_web):
    response = upload(alice_web, good_dataset(12))
    file = File.objects.get()
    assert response["Location"] == reverse("dashboard:dataset", args=[file.id])
    page = alice_web.get(response["Location"]).content.decode()
    assert "12 examples" in page and "What is 0 plus 0?" in page and 'class="bubble assistant' in page


def test_tool_calls_show_readably_in_the_preview_and_on_the_page_of_a_job_that_trains_on_them(alice_web):
    response = upload(alice_web, weather_dataset(12))
    page = alice_web.get(response["Location"]).content.decode()
    assert "Tools: <code>get_weather</code>" in page
    assert "get_weather({&quot;city&quot;: &quot;Paris&quot;}) · call_1" in page  # the call, not an empty bubble
    assert "answers call_1" in page and "It is 26 °C and sunny in Berlin." in page  # the result, and the reply to it
    file = File.objects.get()
    alice_web.post(reverse("dashboard:job_new"), {
        "model": BASE, "training_file": file.id, "suffix": "weather", "n_epochs": 1, "lora_r": 8, "lora_alpha": 16,
        "lora_dropout": 0, "target_modules": ["q_proj", "v_proj"],
    })
    job_page = alice_web.get(reverse("dashboard:job", args=[FineTuningJob.objects.get().id])).content.decode()
    assert 'id="examples"' in job_page and "get_weather({&quot;city&quot;: &quot;Paris&quot;})" in job_page
    file.delete()  # a job outlives its file: its page still shows, without examples
    assert 'id="examples"' not in alice_web.get(reverse("dashboard:job", args=[FineTuningJob.objects.get().id])).content.decode()


def test_the_playground_sends_tools_and_a_conversation_with_calls_and_their_results():
    from core.api_errors import ApiError
    from dashboard.playground import completion_body

    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    chat = {"model": BASE, "tools": [WEATHER_TOOL], "tool_choice": "auto", "messages": [
        {"role": "user", "content": "Weather in Oslo?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "4 degrees"}]}
    sent = json.loads(completion_body(json.dumps(chat).encode()))
    assert sent["tools"] == [WEATHER_TOOL] and sent["messages"][1]["tool_calls"] == [call] and sent["stream"]
    assert "tool_call_id" not in sent["messages"][0]  # what was not sent is not made up
    for broken in ({**chat["messages"][2], "tool_call_id": None}, {"role": "assistant", "content": ""}):
        with pytest.raises(ApiError) as refused:
            completion_body(json.dumps({**chat, "messages": [chat["messages"][0], broken]}).encode())
        assert refused.value.status == 400 and refused.value.param.startswith("messages.1")


def test_a_fine_tune_started_from_the_form_is_queued_with_its_settings(alice_web):
    upload(alice_web, good_dataset(12))
    file = File.objects.get()
    response = alice_web.post(reverse("dashboard:job_new"), {
        "model": BASE, "training_file": file.id, "suffix": "from-web", "n_epochs": 2, "lora_r": 4, "lora_alpha": 8,
        "lora_dropout": 0.1, "target_modules": ["q_proj", "v_proj"],
    })
    job = FineTuningJob.objects.get()
    assert response["Location"] == reverse("dashboard:job", args=[job.id])
    assert job.suffix == "from-web" and job.hyperparameters["n_epochs"] == 2 and job.hyperparameters["lora_r"] == 4
    assert job.hyperparameters["target_modules"] == ["q_proj", "v_proj"]


def test_a_dpo_fine_tune_started_from_the_form_trains_on_preference_pairs_with_its_beta(alice_web):
    upload(alice_web, good_dataset(12), "chat.jsonl")
    upload(alice_web, preference_dataset(12), "pairs.jsonl")
    chat, pairs = File.objects.order_by("created_at")
    form_page = alice_web.get(reverse("dashboard:job_new")).content.decode()
    assert "pairs.jsonl (12 preference pairs" in form_page and "chat.jsonl (12 examples" in form_page
    form = {
        "model": BASE, "method": "dpo", "training_file": pairs.id, "beta": 0.5, "lora_r": 8, "lora_alpha": 16,
        "lora_dropout": 0.05, "target_modules": ["q_proj"],
    }

    wrong_file = alice_web.post(reverse("dashboard:job_new"), form | {"training_file": chat.id}).content.decode()
    assert "the dpo method trains on preference lines" in field_block(wrong_file, "training_file")
    beta_alone = alice_web.post(reverse("dashboard:job_new"), form | {"method": "supervised"}).content.decode()
    assert "beta is DPO&#x27;s" in field_block(beta_alone, "beta")
    assert not FineTuningJob.objects.exists()

    alice_web.post(reverse("dashboard:job_new"), form)
    job = FineTuningJob.objects.get()
    assert (job.method, job.training_file, job.hyperparameters["beta"]) == ("dpo", pairs.id, 0.5)


def test_a_reinforcement_fine_tune_from_the_form_takes_its_grader_as_json_and_refuses_a_broken_one(alice_web):
    upload(alice_web, prompts_dataset(12), "prompts.jsonl")
    prompts = File.objects.get()
    assert "prompts.jsonl (12 prompts" in alice_web.get(reverse("dashboard:job_new")).content.decode()
    grader = {"type": "string_check", "name": "says it", "input": "{{sample.output_text}}",
              "reference": "{{item.reference_answer}}", "operation": "like"}
    form = {"model": BASE, "method": "reinforcement", "training_file": prompts.id, "lora_r": 4, "lora_alpha": 16,
            "lora_dropout": 0.05, "target_modules": ["q_proj"], "n_epochs": 1}

    broken = alice_web.post(reverse("dashboard:job_new"), form | {"grader": "{not json"}).content.decode()
    assert "not JSON that can be read" in field_block(broken, "grader")
    missing = alice_web.post(reverse("dashboard:job_new"), form).content.decode()
    assert "needs a grader" in field_block(missing, "grader")
    python = alice_web.post(reverse("dashboard:job_new"), form | {"grader": json.dumps({"type": "python", "name": "x", "source": "1"})})
    assert "python" in python.content.decode() and not FineTuningJob.objects.exists()

    alice_web.post(reverse("dashboard:job_new"), form | {"grader": json.dumps(grader)})
    job = FineTuningJob.objects.get()
    assert (job.method, job.grader, job.hyperparameters["lora_r"], job.hyperparameters["n_epochs"]) == ("reinforcement", grader, 4, 1)


def test_early_stopping_from_the_form_watches_the_validation_dataset_and_is_refused_without_one(alice_web):
    upload(alice_web, good_dataset(12))
    upload(alice_web, good_dataset(10))
    training, validation = File.objects.order_by("created_at")
    form = {
        "model": BASE, "training_file": training.id, "lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.05,
        "target_modules": ["q_proj"], "n_evals": 4, "n_checkpoints": 2, "early_stopping_patience": 3,
    }
    refused = alice_web.post(reverse("dashboard:job_new"), form)
    assert refused.status_code == 200 and "give a validation_file too" in refused.content.decode()
    assert not FineTuningJob.objects.exists()

    alice_web.post(reverse("dashboard:job_new"), form | {"validation_file": validation.id, "early_stopping_min_delta": 0.01})
    hyperparameters = FineTuningJob.objects.get().hyperparameters
    assert (hyperparameters["n_evals"], hyperparameters["n_checkpoints"]) == (4, 2)
    assert hyperparameters["early_stopping"] == {"patience": 3, "min_delta": 0.01, "metric": "valid_loss"}


def test_form_errors_from_the_service_appear_next_to_their_field(alice_web):
    upload(alice_web, good_dataset(12))
    file = File.objects.get()
    form = {"model": BASE, "training_file": file.id, "lora_r": 64, "lora_alpha": 8, "lora_dropout": 0.1, "target_modules": ["q_proj"]}
    page = alice_web.post(reverse("dashboard:job_new"), form).content.decode()
    field = page[page.index('id="field-lora_r"'):]
    assert "exceeds" in field[: field.index("</div>")]
    assert not FineTuningJob.objects.exists()


def field_block(page: str, name: str) -> str:
    block = page[page.index(f'id="field-{name}"'):]
    return block[: block.index("</div>")]


def test_an_upload_over_the_hourly_rate_is_refused_on_the_page_saying_when_to_try_again(alice_web, settings):
    lower_limits(settings, uploads_per_hour_per_organization=1)
    assert upload(alice_web, good_dataset(12)).status_code == 302
    refused = upload(alice_web, good_dataset(12))
    field = field_block(refused.content.decode(), "file")
    assert "Rate limit reached" in field and "UPLOADS_PER_HOUR_PER_ORGANIZATION" in field and "Try again in" in field
    assert File.objects.count() == 1


def test_an_upload_over_the_storage_quota_is_refused_on_the_page(alice_web, settings):
    lower_limits(settings, storage_bytes_per_organization=len(good_dataset(12)) * 3 // 2)
    assert upload(alice_web, good_dataset(12)).status_code == 302
    field = field_block(upload(alice_web, good_dataset(12)).content.decode(), "file")
    assert "storage quota" in field and "STORAGE_MB_PER_ORGANIZATION" in field and "Delete what it no longer needs" in field
    assert File.objects.count() == 1


def test_a_fine_tune_over_the_queued_jobs_cap_is_refused_on_the_page(alice_web, settings):
    upload(alice_web, good_dataset(12))
    lower_limits(settings, queued_jobs_per_organization=1)
    form = {"model": BASE, "training_file": File.objects.get().id, "lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.05,
            "target_modules": ["q_proj"]}
    assert alice_web.post(reverse("dashboard:job_new"), form).status_code == 302
    page = alice_web.post(reverse("dashboard:job_new"), form).content.decode()
    refusal = page[page.index('class="errors"'):]
    assert "already has 1 queued fine-tuning jobs" in refusal[: refusal.index("</div>")]
    assert FineTuningJob.objects.count() == 1


def test_the_upload_form_carries_the_size_cap_and_its_sentence_for_the_page_to_check_first(alice_web, settings):
    from base.upload_limits import file_too_large_message

    settings.CONFIG = dataclasses.replace(settings.CONFIG, max_upload_bytes=2048)
    field = field_block(alice_web.get(reverse("dashboard:datasets")).content.decode(), "file")
    assert 'data-max-bytes="2048"' in field and f'data-too-large="{file_too_large_message()}"' in field


def test_the_progress_feed_sends_only_the_metrics_reports_the_page_has_not_seen(alice_web):
    upload(alice_web, good_dataset(12))
    alice_web.post(reverse("dashboard:job_new"), {"model": BASE, "training_file": File.objects.get().id, "lora_r": 8,
                                                  "lora_alpha": 16, "lora_dropout": 0.05, "target_modules": ["q_proj"]})
    job = FineTuningJob.objects.get()
    for step, loss in [(1, 2.5), (2, 2.0), (2, 1.9)]:  # step 2 again: a resumed attempt reports it anew
        job.events.create(message=f"Step {step}/3", type="metrics", data={"step": step, "total_steps": 3, "train_loss": loss})
    progress = reverse("dashboard:job_progress", args=[job.id])
    body = alice_web.get(progress).json()
    assert body["job"]["status"] == "queued" and body["metrics_count"] == 3
    assert [report["train_loss"] for report in body["metrics"]] == [2.5, 2.0, 1.9]  # the page keeps the last of a step
    assert body["events"][0]["message"] == "Step 2/3"
    assert alice_web.get(f"{progress}?metrics_from=3").json()["metrics"] == []  # nothing new: nothing sent
    job.events.create(message="Step 3/3", type="metrics", data={"step": 3, "total_steps": 3, "train_loss": 1.5})
    body = alice_web.get(f"{progress}?metrics_from=3").json()
    assert body["metrics"] == [{"step": 3, "total_steps": 3, "train_loss": 1.5}] and body["metrics_count"] == 4
    assert alice_web.get(f"{progress}?metrics_from=-1").status_code == 400


def test_a_new_api_key_is_shown_once_and_can_be_revoked(alice_web, alice):
    page = alice_web.post(reverse("dashboard:api_keys"), {"name": "ci"}).content.decode()
    key = ApiKey.objects.get(name="ci")
    assert 'id="new-key-value"' in page and key.prefix in page
    assert f"tml-{key.prefix}" in page  # the form the tinker SDK takes, beside it
    assert 'id="new-key-value"' not in alice_web.get(reverse("dashboard:api_keys")).content.decode()
    alice_web.post(reverse("dashboard:api_key_revoke", args=[key.prefix]))
    key.refresh_from_db()
    assert not key.is_active


def test_models_and_keys_are_named_in_dashboard_urls_as_people_see_them(alice_web, alice):
    name = register_fine_tuned_model(alice, "support-bot")
    model = FineTunedModel.objects.get(name=name)
    key, _ = create_api_key(alice.organization, alice.user, "laptop")
    delete_url, revoke_url = f"/models/{name}/delete", f"/keys/{key.prefix}/revoke"
    assert reverse("dashboard:model_delete", args=[name]) == delete_url
    assert f'action="{delete_url}"' in alice_web.get(reverse("dashboard:models")).content.decode()
    assert f'action="{revoke_url}"' in alice_web.get(reverse("dashboard:api_keys")).content.decode()
    # The database ids are no names, and unknown names are as absent as another organization's.
    for unknown in (f"/models/{model.pk}/delete", f"/models/{BASE}:nothing/delete", f"/keys/{key.pk}/revoke", "/keys/sk-nothing/revoke"):
        assert alice_web.post(unknown).status_code == 404, unknown
    assert alice_web.post(delete_url)["Location"] == reverse("dashboard:models")
    assert alice_web.post(revoke_url)["Location"] == reverse("dashboard:api_keys")
    assert not FineTunedModel.objects.exists() and not ApiKey.objects.get(pk=key.pk).is_active


def test_a_user_in_two_organizations_can_switch(alice_web, alice, charlie):
    from accounts.models import Membership

    Membership.objects.create(user=alice.user, organization=charlie.organization)
    alice_web.post(reverse("dashboard:switch"), {"organization": charlie.organization.pk})
    assert "Globex" in alice_web.get(reverse("dashboard:jobs")).content.decode()


def test_switching_to_someone_elses_organization_is_refused(alice_web, charlie):
    assert alice_web.post(reverse("dashboard:switch"), {"organization": charlie.organization.pk}).status_code == 403


def test_an_outsider_can_neither_see_nor_touch_anything_of_another_organization(client, alice, charlie):
    alice_web = signed_in(client, alice)
    upload(alice_web, good_dataset(12))
    file = File.objects.get()
    alice_web.post(reverse("dashboard:job_new"), {"model": BASE, "training_file": file.id, "lora_r": 8, "lora_alpha": 16,
                                                  "lora_dropout": 0.05, "target_modules": ["q_proj"]})
    job = FineTuningJob.objects.get()
    model = FineTunedModel.objects.create(name=f"{BASE}:{job.suffix}", organization=alice.organization, job=job, base_model=BASE, suffix=job.suffix)
    key, _ = create_api_key(alice.organization, alice.user, "alice-laptop")
    client.logout()

    charlie_web = signed_in(client, charlie)
    for name, args in [("dashboard:dataset", [file.id]), ("dashboard:job", [job.id]), ("dashboard:job_progress", [job.id])]:
        assert charlie_web.get(reverse(name, args=args)).status_code == 404, name
    for name, args in [("dashboard:dataset_delete", [file.id]), ("dashboard:job_cancel", [job.id]),
                       ("dashboard:model_delete", [model.name]), ("dashboard:api_key_revoke", [key.prefix])]:
        assert charlie_web.post(reverse(name, args=args)).status_code == 404, name
    listings = "".join(charlie_web.get(reverse(name)).content.decode()
                       for name in ("dashboard:datasets", "dashboard:jobs", "dashboard:models", "dashboard:api_keys"))
    for secret in (file.filename, job.suffix, model.name, "alice-laptop"):
        assert secret not in listings
    assert File.objects.exists() and FineTunedModel.objects.exists() and ApiKey.objects.get(pk=key.pk).is_active
    assert FineTuningJob.objects.get().status == "queued"


def test_forms_refuse_posts_without_a_csrf_token(alice):
    from django.test import Client

    strict = Client(enforce_csrf_checks=True)
    strict.force_login(alice.user)
    assert strict.post(reverse("dashboard:api_keys"), {"name": "x"}).status_code == 403


# --- the playground: bad requests are refused here; streaming answers are in test_playground.py ---


def chat(client, body: dict | str, **headers):
    data = body if isinstance(body, str) else json.dumps(body)
    return client.post(reverse("dashboard:playground_chat"), data, content_type="application/json", **headers)


def hello(model: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Hello"}]}


def test_the_playground_offers_the_base_models_and_only_the_organizations_own_fine_tunes(client, alice, charlie):
    mine = register_fine_tuned_model(alice, "mine")
    register_fine_tuned_model(charlie, "theirs")
    page = signed_in(client, alice).get(reverse("dashboard:playground"), {"model": mine, "compare": "1"}).content.decode()
    assert f'<option value="{BASE}"' in page and f'<option value="{mine}" selected' in page
    assert f"{BASE}:theirs" not in page
    second_pane = page[page.index('id="pane-2"'):]
    assert f'<option value="{BASE}" selected' in second_pane  # compare against the base model by default


@pytest.mark.django_db(transaction=True)  # the model lookup runs in another thread, on its own connection
def test_the_playground_answers_404_for_another_organizations_model_and_forwards_nothing(client, alice, charlie):
    register_fine_tuned_model(charlie, "theirs")
    alice_web = signed_in(client, alice)
    for name in (f"{BASE}:theirs", f"{BASE}:nothing-here", "acme/unknown-base"):
        response = chat(alice_web, hello(name))
        assert response.status_code == 404, name
        assert response.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(
    "body, names",
    [
        ("{not json", "body"),
        ({"model": BASE, "messages": []}, "messages"),
        ({"model": BASE, "messages": [{"role": "critic", "content": "x"}]}, "messages.0.role"),
        ({"model": BASE, "messages": [{"role": "tool", "content": "x"}]}, "messages.0: Value error, a tool message"),
        ({"model": BASE, "messages": [{"role": "user", "content": ""}]}, "messages.0: Value error, a message needs content"),
        (hello(BASE) | {"max_tokens": "64"}, "max_tokens"),
        (hello(BASE) | {"temperature": 9}, "temperature"),
        (hello(BASE) | {"logit_bias": {"1": 100}}, "logit_bias"),
    ],
)
def test_a_bad_playground_request_is_refused_naming_the_field(alice_web, body, names):
    response = chat(alice_web, body)
    assert response.status_code == 400
    assert names in response.json()["error"]["message"]


def test_the_playground_needs_a_signed_in_session_and_a_csrf_token(client, alice):
    from django.test import Client

    assert chat(client, hello(BASE)).status_code == 302  # to the sign-in page
    strict = Client(enforce_csrf_checks=True)
    strict.force_login(alice.user)
    assert chat(strict, hello(BASE)).status_code == 403
    assert strict.get(reverse("dashboard:playground_chat")).status_code == 405


def test_the_models_page_says_when_the_pool_cannot_tell_what_is_loaded(alice_web, settings):
    settings.INFERENCE_POOL_URL = "http://127.0.0.1:9"  # nothing listens there
    page = alice_web.get(reverse("dashboard:models")).content.decode()
    assert "The inference pool did not answer" in page and "request id req_" in page
    assert "127.0.0.1:9" not in page  # the pool's address is the operator's: it is in the log, under the request id


def test_the_models_page_shows_a_fine_tunes_lineage_down_to_its_dataset(alice_web, alice):
    upload(alice_web, good_dataset(12), name="support.jsonl")
    file = File.objects.get()
    alice_web.post(reverse("dashboard:job_new"), {"model": BASE, "training_file": file.id, "suffix": "support", "n_epochs": 2,
                                                  "lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.05, "target_modules": ["q_proj"]})
    job = FineTuningJob.objects.get()
    FineTunedModel.objects.create(name=f"{BASE}:support", organization=alice.organization, job=job, base_model=BASE,
                                  suffix="support", final_loss=0.4321)
    page = alice_web.get(reverse("dashboard:models")).content.decode()
    row = page[page.index(f'data-model="{BASE}:support"'):]
    row = row[: row.index("</tr>")]
    for shown in (job.id, "support.jsonl", reverse("dashboard:dataset", args=[file.id]), "epochs 2", "LoRA r 4", "0.4321"):
        assert shown in row, shown


def test_long_listings_come_in_pages_newest_first(alice_web, alice):
    for number in range(52):
        File.objects.create(organization=alice.organization, filename=f"set-{number:02d}.jsonl", bytes=1,
                            storage_key=f"test/{number}", example_count=10, token_count=100, max_example_tokens=10)
    first = alice_web.get(reverse("dashboard:datasets")).content.decode()
    assert "set-51.jsonl" in first and "set-02.jsonl" in first and "set-01.jsonl" not in first
    assert "1–50 of 52" in first and 'href="?page=2"' in first
    second = alice_web.get(reverse("dashboard:datasets"), {"page": 2}).content.decode()
    assert "set-01.jsonl" in second and "set-00.jsonl" in second and "set-51.jsonl" not in second
    assert alice_web.get(reverse("dashboard:datasets"), {"page": "not-a-number"}).status_code == 200  # the first page


def test_the_playground_opens_on_the_newest_fine_tune_beside_its_base_model(client, alice):
    register_fine_tuned_model(alice, "older")
    newest = register_fine_tuned_model(alice, "newer")
    page = signed_in(client, alice).get(reverse("dashboard:playground")).content.decode()
    first_pane, second_pane = page[page.index('id="pane-1"'): page.index('id="pane-2"')], page[page.index('id="pane-2"'):]
    assert f'<option value="{newest}" selected' in first_pane
    assert f'<option value="{BASE}" selected' in second_pane


# --- addresses: one form for each page, without a trailing slash ---


def test_a_page_typed_with_a_trailing_slash_is_a_permanent_redirect_keeping_the_query(alice_web):
    for typed, canonical in [("/datasets/", "/datasets"), ("/jobs/ftjob-abc/?page=2&x=%2F", "/jobs/ftjob-abc?page=2&x=%2F"),
                             ("/keys//", "/keys"), (f"/models/{BASE}:bot/delete/", f"/models/{BASE}:bot/delete")]:
        response = alice_web.get(typed)
        assert (response.status_code, response["Location"]) == (301, canonical), typed
    assert alice_web.head("/datasets/")["Location"] == "/datasets"
    assert alice_web.get("/datasets/", follow=True).status_code == 200


def test_a_post_to_a_slashed_address_is_a_404_naming_the_right_one_and_stores_nothing(alice_web):
    handle = io.BytesIO(good_dataset(12))
    handle.name = "train.jsonl"
    response = alice_web.post("/datasets/", {"file": handle})
    assert response.status_code == 404 and 'href="/datasets"' in response.content.decode()
    assert not File.objects.exists()


def test_a_slashed_address_of_no_page_is_a_404_and_never_a_redirect_to_another_site(alice_web):
    # %2F: the test client would read "//evil.example/" as a host; a browser's request line can hold it.
    for typed in ("/nothing-here/", "/%2Fevil.example/", "/%2F%2Fevil.example//", "/jobs/new/extra/"):
        assert alice_web.get(typed).status_code == 404, typed


def test_api_paths_are_not_redirected(client, alice):
    headers = {"Authorization": f"Bearer {alice.key}"}
    assert client.get("/v1/files", headers=headers).status_code == 200  # as the OpenAI client asks
    slashed = client.get("/v1/files/", headers=headers)
    assert slashed.status_code == 404 and slashed.json()["error"]["code"]  # the API's JSON 404, as before


def test_the_models_page_lists_an_uploaded_adapter_which_has_no_job(alice_web, alice, settings):
    settings.INFERENCE_POOL_URL = "http://127.0.0.1:9"  # which models are loaded does not matter here
    FineTunedModel.objects.create(name=f"{BASE}:uploaded", organization=alice.organization, job=None, base_model=BASE,
                                  suffix="uploaded", uploaded_bytes=1000)
    page = alice_web.get(reverse("dashboard:models")).content.decode()
    row = page[page.index(f'data-model="{BASE}:uploaded"'):]
    assert "uploaded adapter (trained elsewhere)" in row[: row.index("</tr>")]
