# ruff: noqa: F811 (pytest fixtures are imported, then named as arguments)
import dataclasses
import json
import tracemalloc

import pytest

from django.core.files.uploadedfile import TemporaryUploadedFile

from core.api_errors import ApiError
from finetuning import files, storage
from finetuning.models import File
from tests.file_uploads import _named, error_of, stored_keys, upload  # noqa: F401 (stored_keys: a fixture)
from tests.personas import chat_example, good_dataset, jsonl

pytestmark = pytest.mark.django_db


def with_line(number: int, line: str, n: int = 12) -> bytes:
    """A good dataset of ``n`` lines whose line ``number`` is ``line``."""
    records = [record.decode() for record in good_dataset(n).splitlines()]
    records[number - 1] = line
    return ("\n".join(records) + "\n").encode()


def turns(n: int) -> list[dict]:
    """A conversation of ``n`` short user/assistant turns."""
    return [m for i in range(n) for m in chat_example(f"Question {i}?", f"Answer {i}.")["messages"]]


def test_it_accepts_a_chat_dataset_and_counts_examples_and_tokens(alice):
    response = upload(alice, good_dataset(12))
    body = response.json()
    assert response.status_code == 200, body
    assert body["object"] == "file" and body["id"].startswith("file-") and body["purpose"] == "fine-tune"
    assert body["filename"] == "train.jsonl" and body["bytes"] == len(good_dataset(12))
    assert body["example_count"] == 12 and body["token_count"] > 12 * 10


def test_it_accepts_prompt_completion_lines(alice):
    data = jsonl([{"prompt": f"Say {i}", "completion": f"{i}!"} for i in range(10)])
    assert upload(alice, data).status_code == 200


def test_the_content_comes_back_byte_for_byte(alice):
    file_id = upload(alice, good_dataset()).json()["id"]
    response = alice.api.get(f"/v1/files/{file_id}/content")
    assert response.status_code == 200 and response.streaming and b"".join(response.streaming_content) == good_dataset()


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        ({7: '{"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "x"}]}'},
         "line 7: messages[1].role must be one of system, user, assistant"),
        ({3: "{not json"}, "line 3: not valid JSON"),
        ({4: '["a list"]'}, 'line 4: must be a JSON object with "messages"'),
        ({2: '{"messages": [{"role": "user", "content": "only a question"}]}'},
         "line 2: needs at least one assistant message"),
        ({5: '{"messages": [{"role": "user", "content": 42}, {"role": "assistant", "content": "x"}]}'},
         "line 5: messages[0].content must be a string"),
        ({6: '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "weight": 2}]}'},
         "line 6: messages[1].weight must be 0 or 1"),
        ({8: '{"prompt": "only a prompt"}'}, "line 8: prompt and completion must both be strings"),
        ({9: '{"text": "hello"}'}, 'line 9: must have "messages", "prompt" and "completion", or "input", "preferred_output" and "non_preferred_output"'),
    ],
)
def test_it_names_the_line_and_the_problem_of_a_bad_example(alice, lines, expected):
    records = [line.decode() for line in good_dataset(12).splitlines()]
    for number, text in lines.items():
        records[number - 1] = text
    response = upload(alice, ("\n".join(records) + "\n").encode())
    assert response.status_code == 400
    assert expected in error_of(response)["message"]
    assert error_of(response)["param"] == "file" and error_of(response)["code"] == "invalid_file"
    assert not File.objects.exists()


@pytest.mark.parametrize(
    ("number", "line", "expected"),
    [
        (5, '{"messages": ' + "[" * 5000 + "]" * 5000 + "}",
         "line 5: the JSON is nested 5,001 levels deep, more than 32: a chat line needs 3, a preference line 4"),
        (3, json.dumps({"messages": [{"role": "assistant", "content": "Hi!"}, *turns(1)]}),
         "line 3: messages[0] is from the assistant: start with the user (or system) message it answers"),
        (4, json.dumps(chat_example("half a smiley \ud83d here", "a")),
         "line 4: messages[0].content contains \\ud83d, half of a UTF-16 surrogate pair without its other half: "
         "remove it, or write the whole character"),
        (6, json.dumps({"prompt": "q", "completion": "\udc00"}), "line 6: completion contains \\udc00, half of"),
        (7, json.dumps(chat_example("q", "a\x00b")),
         "line 7: messages[1].content contains a NUL character (\\u0000): remove it"),
        (8, '{"prompt": "q", "completion": "a"}\x00',
         "line 8: contains NUL bytes (0x00), so the file looks binary or UTF-16"),
        (9, '{"prompt": "q", "completion": "a", "id": ' + "7" * 5000 + "}",
         "line 9: has a number with more than 4,300 digits, too long to read"),
        (10, json.dumps({"messages": turns(2000)}),
         "line 10: 4,000 messages, more than the 1,024 allowed for the model's context of 2048 tokens: "
         "split the conversation over several lines"),
        (11, json.dumps(chat_example("word " * 60_000, "a")),
         "line 11: the line is 300,086 characters long, more than the 262,144 characters allowed for the model's context of "
         "2048 tokens: split the conversation over several lines"),
    ],
    ids=["deep-nesting", "assistant-first", "lone-surrogate", "lone-surrogate-completion", "nul-escape",
         "nul-byte", "long-number", "2000-turns", "long-line"],
)
def test_it_refuses_a_line_that_used_to_crash_or_stall_the_check_naming_it(alice, stored_keys, number, line, expected):
    files_before = File.objects.count()
    response = upload(alice, with_line(number, line))
    assert response.status_code == 400, response.content[:300]
    error = error_of(response)
    assert expected in error["message"] and error["code"] == "invalid_file"
    assert [e["line"] for e in error["errors"]] == [number]
    assert File.objects.count() == files_before and stored_keys == []


def test_it_refuses_a_utf16_file_saying_to_save_it_as_utf8(alice, stored_keys):
    response = upload(alice, good_dataset(12).decode().encode("utf-16-le"))
    assert response.status_code == 400
    assert "line 1: contains NUL bytes (0x00), so the file looks binary or UTF-16: save it as UTF-8 text" in (
        error_of(response)["message"]
    )
    assert not File.objects.exists() and stored_keys == []


def test_it_accepts_line_and_paragraph_separators_inside_strings(alice, stored_keys):
    # Valid JSON may hold these as they are; only "\n" ends a JSONL line.
    separators = ["\u2028", "\u2029", "\x85"]
    records = [chat_example(f"Split{s}here?", f"No{s}split.") for s in separators] * 4
    data = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records).encode()
    body = upload(alice, data).json()
    assert body.get("example_count") == 12, body
    assert stored_keys == [f"files/{alice.organization.pk}/{body['id']}.jsonl"]


def test_it_accepts_a_conversation_that_opens_with_a_system_message_and_an_assistant_greeting(alice):
    greeting = {"messages": [{"role": "system", "content": "Greet first."}, {"role": "assistant", "content": "Hello!"}]}
    response = upload(alice, jsonl([greeting] * 12))
    assert response.status_code == 200, response.json()


def test_it_lists_every_bad_line_up_to_a_limit(alice):
    records = ["{bad"] * 30 + [line.decode() for line in good_dataset(12).splitlines()]
    error = error_of(upload(alice, "\n".join(records).encode()))
    assert error["message"].startswith("Invalid training file: 30 lines have problems; the first 20 are listed")
    assert [e["line"] for e in error["errors"]] == list(range(1, 21))


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"", "the file is empty"),
        (b"\n  \n", "the file is empty"),
        (good_dataset(2)[:30] + b"\xff\xfe" + b"\n", "the file is not UTF-8 text (line 1 has the byte 0xff)"),
        (good_dataset(4), "needs at least 10 examples, found 4"),
    ],
)
def test_it_refuses_files_that_cannot_train_with_a_reason(alice, data, expected):
    response = upload(alice, data)
    assert response.status_code == 400 and expected in error_of(response)["message"]


def test_it_reports_examples_longer_than_the_models_context(alice):
    records = [chat_example("q", "a")] * 11 + [chat_example("word " * 3000, "a")]
    message = error_of(upload(alice, jsonl(records)))["message"]
    assert "line 12: " in message and "longer than the model's context of 2048 tokens" in message


def test_it_refuses_an_oversized_upload_before_storing_anything(alice, settings):
    settings.CONFIG = dataclasses.replace(settings.CONFIG, max_upload_bytes=1024)
    response = upload(alice, good_dataset(50))
    assert response.status_code == 413
    assert error_of(response)["message"].endswith("the limit is 1024 bytes (MAX_UPLOAD_MB).")
    assert not File.objects.exists()


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        ({"purpose": "fine-tune"}, "file: No file was submitted."),
        ({"file": "not-a-file", "purpose": "fine-tune"}, "file: "),
        ({"file": _named(good_dataset(), "t.jsonl"), "purpose": "assistants"}, "purpose must be 'fine-tune'"),
    ],
)
def test_it_explains_a_malformed_upload(alice, payload, expected):
    response = alice.api.post("/v1/files", payload, format="multipart")
    assert response.status_code == 400 and expected in error_of(response)["message"]


def test_files_are_listed_newest_first_with_pagination(alice):
    ids = [upload(alice, good_dataset()).json()["id"] for _ in range(3)]
    first = alice.api.get("/v1/files?limit=2").json()
    assert [f["id"] for f in first["data"]] == ids[::-1][:2] and first["has_more"]
    rest = alice.api.get(f"/v1/files?limit=2&after={first['last_id']}").json()
    assert [f["id"] for f in rest["data"]] == [ids[0]] and not rest["has_more"]


def test_a_teammate_sees_the_file_and_an_outsider_gets_404(alice, bob, charlie):
    file_id = upload(alice, good_dataset()).json()["id"]
    assert bob.api.get(f"/v1/files/{file_id}").status_code == 200
    for call in (charlie.api.get, charlie.api.delete):
        response = call(f"/v1/files/{file_id}")
        assert response.status_code == 404 and error_of(response)["message"] == f"No such file: '{file_id}'"
    assert charlie.api.get(f"/v1/files/{file_id}/content").status_code == 404
    assert charlie.api.get("/v1/files").json()["data"] == []


def test_deleting_a_file_removes_it(alice):
    file_id = upload(alice, good_dataset()).json()["id"]
    assert alice.api.delete(f"/v1/files/{file_id}").json() == {"id": file_id, "object": "file", "deleted": True}
    assert alice.api.get(f"/v1/files/{file_id}").status_code == 404


def test_it_refuses_requests_without_a_valid_key(client):
    response = client.get("/v1/files")
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    response = client.get("/v1/files", HTTP_AUTHORIZATION="Bearer sk-wrong")
    assert response.status_code == 401 and "Incorrect API key" in response.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/files", "/v1/fine_tuning/jobs"])
def test_a_nul_character_in_a_list_cursor_is_a_400_on_every_database(alice, path):
    # PostgreSQL refuses NUL in text (a DataError): found by the schema fuzzer as a 500.
    response = alice.api.get(f"{path}?after=file-%00x")
    assert response.status_code == 400 and response.json()["error"]["param"] in ("after", None), response.json()


def _spooled(data: bytes) -> TemporaryUploadedFile:
    """An upload as Django hands over a large one: in a temporary file on disk."""
    upload = TemporaryUploadedFile("big.jsonl", "application/jsonl", len(data), None)
    upload.write(data)
    upload.seek(0)
    return upload


def _peak_bytes(call) -> int:
    tracemalloc.start()
    try:
        call()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_an_upload_is_checked_and_stored_a_line_at_a_time_never_whole_in_memory(alice):
    line = json.dumps(chat_example("Tell me about the weather. " * 40, "It is mild and dry today. " * 40)) + "\n"
    data = (line * (4 * 1024 * 1024 // len(line))).encode()  # 4 MB of 2 KB lines
    files.check_dataset(line.encode() * 10)  # the tokenizer is loaded once per process: not this test's cost
    spooled, created = _spooled(data), []
    peak = _peak_bytes(lambda: created.append(files.upload_file(alice.organization, alice.user, spooled, files.PURPOSE)))
    assert created[0].bytes == len(data) and created[0].example_count == data.count(b"\n")
    assert storage.files().get(created[0].storage_key) == data
    assert peak < len(data) / 4, f"{peak:,} bytes at the peak for a {len(data):,}-byte file"


def test_a_line_too_long_for_the_context_is_refused_by_number_without_being_read_whole(alice, stored_keys):
    good = jsonl([chat_example("q", "a")] * 12)
    endless = b'{"messages": [{"role": "user", "content": "' + b"x" * (32 * 1024 * 1024) + b'"}]}\n'
    files.check_dataset(good)
    spooled, refusals = _spooled(good + endless + good), []

    def upload_it() -> None:
        with pytest.raises(ApiError) as refused:
            files.upload_file(alice.organization, alice.user, spooled, files.PURPOSE)
        refusals.append(refused.value)

    peak = _peak_bytes(upload_it)
    assert [(error["line"], "over 1,048,576 bytes" in error["message"]) for error in refusals[0].extra["errors"]] == [(13, True)]
    assert peak < 8 * 1024 * 1024 and stored_keys == [] and not File.objects.exists()
