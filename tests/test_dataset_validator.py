"""The upload check never breaks, and counts the tokens the trainer feeds, in time linear in the turns.

Property-based (hypothesis, a fixed number of examples per test): whatever the bytes, the check
answers with line errors that name real, bad lines; valid datasets pass; and the token count, with
its trained-token mask, equals the prefix-by-prefix algorithm the trainer used before.
"""

from __future__ import annotations

import codecs
import json
import os
import subprocess
import sys
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.chat_tokens import example_token_count, tokenize_example
from core.datasets import ROLES, Dataset, ExampleError, LineError, parse_dataset
from finetuning.files import check_dataset
from finetuning.tokens import _tokenizer, default_model
from tests.environment import ROOT

# Sized by examples, not time. Failures found are replayed first next time (tests/environment.py says where
# hypothesis keeps them).
FEW, SOME, MANY = 40, 150, 250


def examples(count: int) -> settings:
    return settings(max_examples=count, deadline=None)


@pytest.fixture(scope="module")
def tokenizer():
    return _tokenizer(default_model().id)  # the one check_dataset counts with


# The trainer's algorithm before this module: every reply's prompt and the conversation through it are
# rendered, so its cost grows with the square of the turns. Kept verbatim as the reference.


def reference_render(tokenizer, messages, add_generation_prompt=False):
    plain = [{"role": message["role"], "content": message["content"]} for message in messages]
    return tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=add_generation_prompt)


def reference_reply_spans(tokenizer, example, text):
    spans = []
    for index, message in enumerate(example):
        if message["role"] != "assistant":
            continue
        before = reference_render(tokenizer, example[:index], add_generation_prompt=True)
        through = reference_render(tokenizer, example[: index + 1])
        if not (text.startswith(through) and through.startswith(before)):
            raise ValueError(f"message {index} is not rendered as a prefix")
        end = max(len(through.rstrip()), len(before))
        spans.append((len(before), end, message.get("weight", 1) != 0))
    return spans


def reference_tokenize_example(tokenizer, example) -> tuple[list[int], list[bool]]:
    text = reference_render(tokenizer, example)
    input_ids, trained = [], []

    def add(piece, is_trained):
        ids = tokenizer(piece, add_special_tokens=False)["input_ids"] if piece else []
        input_ids.extend(ids)
        trained.extend([is_trained] * len(ids))

    cursor = 0
    for start, end, is_trained in reference_reply_spans(tokenizer, example, text):
        add(text[cursor:start], False)
        add(text[start:end], is_trained)
        cursor = end
    add(text[cursor:], False)
    if trained:
        trained[0] = False
    return input_ids, trained


class TemplateSpy:
    """The tokenizer, counting its chat template renderings, and rendering with ``template`` if given."""

    def __init__(self, tokenizer, template: str | None = None):
        self.tokenizer, self.template, self.renders = tokenizer, template, 0

    def apply_chat_template(self, messages, **kwargs):
        self.renders += 1
        if self.template is not None:
            kwargs["chat_template"] = self.template
        return self.tokenizer.apply_chat_template(messages, **kwargs)

    def __call__(self, *args, **kwargs):
        return self.tokenizer(*args, **kwargs)


# Strategies. Contents mix template look-alikes, whitespace (which BPE merges across cuts), brackets and
# escapes (which the nesting check must see as text), and any text UTF-8 can carry.
TRICKY_PIECES = ["<|im_start|>assistant\n", "<|im_end|>", "\n", "  ", "\t", " Paris", "user", "\u2028", "é😀"]
TRICKY_PIECES += ["[" * 40, "{" * 40, '\\"', "\\", '"']
PIECE = st.sampled_from(TRICKY_PIECES) | st.text(st.characters(codec="utf-8"), max_size=6)
CONTENT = st.lists(PIECE, max_size=4).map("".join)
VALID_CONTENT = CONTENT.filter(lambda text: "\x00" not in text)


def message(role: str, content: st.SearchStrategy[str] = CONTENT) -> st.SearchStrategy[dict]:
    weight = {"weight": st.sampled_from([0, 1])} if role == "assistant" else {}
    return st.fixed_dictionaries({"role": st.just(role), "content": content}, optional=weight)


@st.composite
def conversations(draw, content: st.SearchStrategy[str] = CONTENT, max_messages: int = 12) -> list[dict]:
    """Conversations the validator lets through: opened by a system or user message, ending with a
    trained reply."""
    opening = draw(st.lists(st.sampled_from(["system", "user"]), min_size=1, max_size=2))
    middle = draw(st.lists(st.sampled_from(["user", "assistant", "assistant", "system"]), max_size=max_messages))
    messages = [draw(message(role, content)) for role in opening + middle]
    return [*messages, {"role": "assistant", "content": draw(content), "weight": 1}]


def line_of(record: dict, ascii_only: bool) -> str:
    return json.dumps(record, ensure_ascii=ascii_only)


@st.composite
def valid_datasets(draw) -> tuple[bytes, list[list[dict]]]:
    """A file of 10 to 14 valid lines (chat or prompt/completion), and the examples it holds."""
    records = draw(
        st.lists(
            conversations(VALID_CONTENT, max_messages=6).map(lambda messages: {"messages": messages})
            | st.fixed_dictionaries({"prompt": VALID_CONTENT, "completion": VALID_CONTENT}),
            min_size=10,
            max_size=14,
        )
    )
    ending = draw(st.sampled_from(["\n", "\r\n"]))
    lines = [line_of(record, draw(st.booleans())) for record in records]
    data = "".join(line + ending + draw(st.sampled_from(["", "\n", " \n"])) for line in lines)
    return draw(st.sampled_from(["", "\ufeff"])).encode() + data.encode(), [expected_example(r) for r in records]


def expected_example(record: dict) -> list[dict]:
    if "messages" in record:
        return [{"weight": 1, **message} for message in record["messages"]]
    return [
        {"role": "user", "content": record["prompt"], "weight": 1},
        {"role": "assistant", "content": record["completion"], "weight": 1},
    ]


# Any text, with lone surrogates (which JSON escapes can write) and NULs made likely.
HAZARDS = st.sampled_from(["\ud800", "\udbff", "\udc00", "\udfff", "\x00"])
ANY_TEXT = st.lists(st.characters() | HAZARDS, max_size=12).map("".join)
KEYS = st.sampled_from(
    ["messages", "role", "content", "weight", "prompt", "completion", "input", "preferred_output", "non_preferred_output"]
) | ANY_TEXT
ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | ANY_TEXT | st.sampled_from(ROLES),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=4),
    max_leaves=12,
)
NEARLY_A_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(ROLES) | ANY_JSON, "content": ANY_TEXT | ANY_JSON},
    optional={"weight": st.sampled_from([0, 1, 2, -1, 1.0, True, None, "1"])},
)
NEARLY_A_CHAT = st.fixed_dictionaries(
    {"messages": st.lists(NEARLY_A_MESSAGE, max_size=6) | ANY_JSON}, optional={"prompt": ANY_TEXT}
)
NEARLY_A_COMPLETION = st.fixed_dictionaries({}, optional=dict.fromkeys(["prompt", "completion"], ANY_TEXT | ANY_JSON))
NEARLY_A_RECORD = NEARLY_A_CHAT | NEARLY_A_COMPLETION | ANY_JSON
DAMAGE = {"role": st.sampled_from(ROLES) | ANY_JSON, "content": ANY_TEXT | ANY_JSON, "weight": ANY_JSON}


@st.composite
def damaged_conversations(draw) -> dict:
    """A valid conversation with one field of one message changed, or its first messages cut off."""
    messages = draw(conversations(VALID_CONTENT, max_messages=4))
    index = draw(st.integers(0, len(messages) - 1))
    if draw(st.booleans()):
        return {"messages": messages[index:]}
    field = draw(st.sampled_from(sorted(DAMAGE)))
    messages[index] = {**messages[index], field: draw(DAMAGE[field])}
    return {"messages": messages}


DEEP_NESTING = st.integers(0, 3000).map(lambda depth: '{"messages": ' + "[" * depth + "]" * depth + "}")
LONG_NUMBER = st.integers(4000, 5000).map(lambda digits: '{"prompt": "q", "n": ' + "9" * digits + "}")
HOSTILE_LINE = st.one_of(
    st.builds(line_of, NEARLY_A_RECORD, st.booleans()),
    st.builds(line_of, damaged_conversations(), st.booleans()),
    DEEP_NESTING,
    LONG_NUMBER,
    ANY_TEXT,
)


def hostile_file(lines: list[str]) -> bytes:
    # surrogatepass: a lone surrogate written as it is makes the file invalid UTF-8, which is refused too.
    return "\n".join(lines).encode("utf-8", "surrogatepass")


# The properties every checked file must have.


def assert_only_line_errors_naming_bad_lines(data: bytes, dataset: Dataset) -> None:
    """Every error names a real, non-blank line, refused alone with the same message, and every other
    non-blank line is an example (when no error was left unlisted)."""
    try:
        lines = data.decode("utf-8-sig").split("\n")
    except UnicodeDecodeError:
        assert dataset.problem.startswith("the file is not UTF-8 text (line ") and not dataset.errors
        line = int(dataset.problem.split("(line ")[1].split(" ")[0])
        assert 1 <= line <= data.count(b"\n") + 1
        return
    for error in dataset.errors:
        assert 1 <= error.line <= len(lines) and lines[error.line - 1].strip(), error
        # A BOM of our own: a line that starts with U+FEFF must not lose it to the decoding.
        alone, _ = check_dataset(codecs.BOM_UTF8 + lines[error.line - 1].encode())
        assert alone.errors == [LineError(1, error.message)]
    if not (dataset.problem or "").endswith("are listed"):
        non_blank = {number for number, line in enumerate(lines, start=1) if line.strip()}
        assert {error.line for error in dataset.errors} | set(dataset.lines) == non_blank
        assert not {error.line for error in dataset.errors} & set(dataset.lines)


# The validator.


@examples(MANY)
@given(st.binary(max_size=400))
def test_it_answers_any_bytes_with_line_errors_only(data):
    dataset, _ = check_dataset(data)
    assert_only_line_errors_naming_bad_lines(data, dataset)


@examples(MANY)
@given(st.lists(st.text(max_size=40), max_size=12).map("\n".join))
def test_it_answers_any_unicode_text_with_line_errors_only(text):
    data = text.encode()
    dataset, _ = check_dataset(data)
    assert_only_line_errors_naming_bad_lines(data, dataset)


@examples(MANY)
@given(st.lists(HOSTILE_LINE, min_size=1, max_size=14))
def test_it_answers_any_json_with_line_errors_only(lines):
    data = hostile_file(lines)
    dataset, _ = check_dataset(data)
    assert_only_line_errors_naming_bad_lines(data, dataset)


@examples(FEW)
@given(st.lists(HOSTILE_LINE, min_size=1, max_size=4), valid_datasets())
def test_bad_lines_are_named_among_good_ones(bad_lines, valid):
    data, _ = valid
    data = data + hostile_file(["", *bad_lines, ""])
    dataset, _ = check_dataset(data)
    assert_only_line_errors_naming_bad_lines(data, dataset)


@examples(FEW)
@given(valid_datasets())
def test_it_accepts_valid_datasets_and_counts_what_the_trainer_feeds(tokenizer, valid):
    data, expected = valid
    dataset, counts = check_dataset(data)
    assert dataset.ok, (dataset.problem, dataset.errors)
    assert dataset.examples == expected
    assert counts == [len(tokenize_example(tokenizer, example).input_ids) for example in expected]


def test_a_chat_template_that_refuses_a_conversation_gives_a_line_error(tokenizer):
    refusing = TemplateSpy(tokenizer, template="{{ raise_exception('Conversation roles must alternate') }}")
    data = (json.dumps({"prompt": "q", "completion": "a"}) + "\n").encode()
    dataset = parse_dataset(data, 1, lambda example: example_token_count(refusing, example), max_tokens=2048)
    refusal = "the chat template refuses this conversation: Conversation roles must alternate"
    assert dataset.errors == [LineError(1, refusal)]


# The token count.


@examples(SOME)
@given(conversations())
def test_its_tokens_and_mask_equal_the_prefix_by_prefix_algorithm(tokenizer, conversation):
    tokens = tokenize_example(tokenizer, conversation)
    assert (tokens.input_ids, tokens.trained) == reference_tokenize_example(tokenizer, conversation)
    assert example_token_count(tokenizer, conversation) == len(tokens.input_ids)


def long_conversation(turns: int) -> list[dict]:
    messages = [{"role": "system", "content": "Answer briefly."}]
    for i in range(turns):
        messages.append({"role": "user", "content": f" Question {i}?\n"})
        messages.append({"role": "assistant", "content": f" {i}", "weight": i % 3 % 2})  # weights 0, 1, 0, 0, 1...
    return messages


def test_a_long_conversation_gets_the_tokens_and_mask_of_the_prefix_by_prefix_algorithm(tokenizer):
    tokens = tokenize_example(tokenizer, long_conversation(80))
    assert (tokens.input_ids, tokens.trained) == reference_tokenize_example(tokenizer, long_conversation(80))
    assert 0 < tokens.n_trained < len(tokens.input_ids)


def test_it_renders_the_chat_template_a_fixed_number_of_times_whatever_the_turns(tokenizer):
    renders = {}
    for turns in (3, 30, 300):
        spy = TemplateSpy(tokenizer)
        tokenize_example(spy, long_conversation(turns))
        renders[turns] = spy.renders
    # A fixed number of renderings, each linear in the turns (prefix by prefix it was two per reply).
    assert renders[3] == renders[30] == renders[300], renders


def test_it_refuses_a_template_that_rewrites_earlier_turns(tokenizer):
    # Earlier replies are shortened once a later one follows, as some templates drop earlier reasoning.
    rewriting = TemplateSpy(tokenizer, template=(
        "{% for m in messages %}{{ m.role }}: {{ m.content if loop.last or m.role != 'assistant' else '...' }}\n"
        "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    ))
    with pytest.raises(ExampleError, match="does not render message 2 of this conversation as a prefix"):
        tokenize_example(rewriting, long_conversation(3))


def test_it_refuses_loudly_a_template_that_frames_later_replies_unlike_the_first(tokenizer):
    # Prefix by prefix, numbered turns could be found; by the first reply's framing they cannot, and the
    # conversation is refused rather than trained with a wrong mask.
    numbering = TemplateSpy(tokenizer, template=(
        "{% for m in messages %}<{{ m.role }} {{ loop.index }}>{{ m.content }}</>\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant {{ messages | length + 1 }}>{% endif %}"
    ))
    assert reference_tokenize_example(numbering, long_conversation(3))
    with pytest.raises(ExampleError, match="frames message 4 of this conversation unlike its first reply"):
        tokenize_example(numbering, long_conversation(3))


# The web process.


def test_checking_an_upload_does_not_import_torch():
    script = textwrap.dedent("""
        import json, sys
        import django
        django.setup()
        from finetuning.files import check_dataset
        records = [{"prompt": f"Say {i}", "completion": f"{i}!"} for i in range(12)]
        dataset, counts = check_dataset("".join(json.dumps(r) + "\\n" for r in records).encode())
        assert dataset.ok and sum(counts) > 12 * 5, (dataset, counts)
        assert "torch" not in sys.modules, "checking an upload imported torch"
    """)
    environment = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "server.settings",
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "platform")]),
    }
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=environment, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
