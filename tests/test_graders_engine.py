"""The grader engine: OpenAI's graders applied to an item and a sample, model graders through a
judge, and a Result (never an exception) for whatever a tenant's data does.

The judges here are fakes (functions returning a fixed reply): the real judge is a model in the
serving pool, which the platform wires in; what this module owns is the request it is sent and the
reading of its reply.
"""

from __future__ import annotations

import json

import pytest

from core.graders.engine import JudgeUnavailable, Result, grade, sample_of
from core.graders.judging import JudgeRequest, judge_request, read_verdict
from core.graders.spec import checked_grader

STRING_CHECK = checked_grader(
    {
        "type": "string_check",
        "name": "Example string check grader",
        "input": "{{sample.output_text}}",
        "reference": "{{item.reference_answer}}",
        "operation": "eq",
    },
    "grader",
)
SCORE_MODEL = checked_grader(
    {
        "type": "score_model",
        "name": "quality",
        "model": "judge-model",
        "input": [
            {"role": "developer", "content": "You grade answers."},
            {"role": "user", "content": "Reference: {{item.reference_answer}}\nAnswer: {{sample.output_text}}"},
        ],
        "range": [0, 10],
        "sampling_params": {"seed": 7, "max_completions_tokens": 100},
    },
    "grader",
)
LABEL_MODEL = checked_grader(
    {
        "type": "label_model",
        "name": "sentiment",
        "model": "judge-model",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Classify: {{sample.output_text}}"}]}],
        "labels": ["positive", "neutral", "negative"],
        "passing_labels": ["positive"],
    },
    "grader",
)
ITEM = {"reference_answer": "fuzzy wuzzy was a bear"}


def replying(text: str):
    def judge(request: JudgeRequest) -> str:
        return text

    return judge


def unavailable(request: JudgeRequest) -> str:
    raise JudgeUnavailable("no replica of judge-model is ready")


def multi(graders: dict, formula: str, **extra: object) -> dict:
    raw = {"type": "multi", "name": "m", "graders": graders, "calculate_output": formula, **extra}
    return checked_grader(raw, "g", pass_threshold="pass_threshold" in extra)


# --- string_check and text_similarity -------------------------------------------------------------


def test_openais_documented_string_check_passes_an_exact_answer():
    result = grade(STRING_CHECK, ITEM, sample_of("fuzzy wuzzy was a bear"))
    assert (result.score, result.passed) == (1.0, True)
    assert grade(STRING_CHECK, ITEM, sample_of("Fuzzy wuzzy was a bear")) == Result(0.0, False, {})


@pytest.mark.parametrize(
    "operation, answer, matched",
    [
        ("eq", "Paris", True),
        ("ne", "Paris", False),
        ("ne", "Lyon", True),
        ("like", "It is Paris.", True),
        ("like", "It is paris.", False),
        ("ilike", "IT IS PARIS.", True),
        ("ilike", "Lyon", False),
    ],
)
def test_string_check_operations_as_openai_defines_them(operation: str, answer: str, matched: bool):
    grader = {**STRING_CHECK, "operation": operation, "reference": "Paris"}
    assert grade(grader, {}, sample_of(answer)).score == (1.0 if matched else 0.0)


def test_a_missing_item_field_is_an_empty_reference_not_a_crash():
    result = grade(STRING_CHECK, {}, sample_of("anything"))
    assert (result.score, result.passed) == (0.0, False)


def test_text_similarity_scores_the_metric_and_passes_against_its_threshold():
    grader = checked_grader(
        {
            "type": "text_similarity",
            "name": "overlap",
            "input": "{{sample.output_text}}",
            "reference": "{{item.reference_answer}}",
            "evaluation_metric": "rouge_1",
            "pass_threshold": 0.8,
        },
        "testing_criteria.0",
        pass_threshold=True,
    )
    close = grade(grader, {"reference_answer": "the cat sat on the mat"}, sample_of("the cat sat on a mat"))
    assert close.score == pytest.approx(5 / 6) and close.passed is True
    assert grade(grader, {"reference_answer": "a b c"}, sample_of("d e f")).passed is False
    without = {key: value for key, value in grader.items() if key != "pass_threshold"}
    assert grade(without, {"reference_answer": "a"}, sample_of("a")).passed is None  # no threshold: no verdict


def test_a_huge_answer_is_graded_in_bounded_time():
    grader = {**STRING_CHECK, "operation": "ilike"}
    assert grade(grader, {"reference_answer": "needle"}, sample_of("hay " * 100_000 + "needle")).score in (0.0, 1.0)


# --- the sample namespace -------------------------------------------------------------------------


def test_sample_of_parses_json_answers_into_output_json():
    sample = sample_of('{"name": "Ada", "email": "ada@example.com"}')
    assert sample["output_json"] == {"name": "Ada", "email": "ada@example.com"}
    assert sample_of("not json")["output_json"] is None
    assert sample_of("NaN")["output_json"] is None  # not JSON, though Python's parser takes it
    assert sample_of('{"a": ' * 500 + "1" + "}" * 500)["output_json"] is None  # too deep: not parsed, no crash


def test_sample_of_carries_tool_calls_as_output_tools_and_choices():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    sample = sample_of("", [call])
    assert sample["output_tools"] == [call]
    assert sample["choices"][0]["message"]["tool_calls"] == [call]
    grader = {**STRING_CHECK, "input": "{{sample.output_tools.0.function.name}}", "reference": "get_weather"}
    assert grade(grader, {}, sample).passed is True


def test_a_grader_on_output_json_fields():
    grader = {**STRING_CHECK, "input": "{{sample.output_json.city}}", "reference": "{{item.city}}"}
    assert grade(grader, {"city": "Paris"}, sample_of('{"city": "Paris"}')).passed is True
    assert grade(grader, {"city": "Paris"}, sample_of("Paris")).passed is False  # not JSON: the field is missing


# --- model graders: the request and the verdict ---------------------------------------------------


def test_the_judge_request_substitutes_templates_and_asks_for_the_verdict_first():
    request = judge_request(SCORE_MODEL, ITEM, sample_of("a bear"))
    assert request.model == "judge-model"
    assert request.messages[0]["role"] == "system" and request.messages[0]["content"].startswith("You grade answers.")
    assert request.messages[1] == {"role": "user", "content": "Reference: fuzzy wuzzy was a bear\nAnswer: a bear"}
    assert request.sampling == {"temperature": 0.0, "top_p": 1.0, "seed": 7, "max_completion_tokens": 100}
    schema = request.response_format["json_schema"]["schema"]
    assert list(schema["properties"]) == ["result", "reasoning"]
    assert schema["properties"]["result"] == {"type": "number", "minimum": 0.0, "maximum": 10.0}
    assert schema["required"] == ["result"]


def test_a_label_judge_request_enumerates_the_labels_and_adds_a_system_message():
    request = judge_request(LABEL_MODEL, {}, sample_of("I love it"))
    assert request.messages[0]["role"] == "system" and '"positive"' in request.messages[0]["content"]
    assert request.messages[1] == {"role": "user", "content": "Classify: I love it"}
    label = request.response_format["json_schema"]["schema"]["properties"]["label"]
    assert label == {"type": "string", "enum": ["positive", "neutral", "negative"]}
    assert request.sampling["temperature"] == 0.0  # greedy by default


def test_a_score_model_scores_the_judges_result_with_its_reasoning():
    result = grade(SCORE_MODEL, ITEM, sample_of("a bear"), replying('{"result": 7.5, "reasoning": "close"}'))
    assert result.score == 7.5 and result.passed is None
    assert result.details["reasoning"] == "close"
    assert grade(SCORE_MODEL, ITEM, sample_of("x"), replying('{"result": 7.5}'), pass_threshold=7).passed is True
    assert grade(SCORE_MODEL, ITEM, sample_of("x"), replying('{"result": 6}'), pass_threshold=7).passed is False


def test_a_judge_that_copies_the_formats_placeholder_as_its_reasoning_shows_no_reasoning():
    # SmolLM2-135M, judging on the running platform, answered {"label": "pirate", "reasoning": "one or two sentences"}.
    copied = grade(LABEL_MODEL, {}, sample_of("great"), replying('{"label": "positive", "reasoning": "one or two sentences"}'))
    assert copied.details == {"label": "positive"}


def test_a_score_outside_the_range_is_clamped_into_it():
    assert grade(SCORE_MODEL, ITEM, sample_of("x"), replying('{"result": 42}')).score == 10.0
    assert grade(SCORE_MODEL, ITEM, sample_of("x"), replying('{"result": -3}')).score == 0.0


def test_a_label_model_passes_on_a_passing_label():
    positive = grade(LABEL_MODEL, {}, sample_of("great"), replying('{"label": "positive", "reasoning": "upbeat"}'))
    assert (positive.score, positive.passed, positive.details["label"]) == (1.0, True, "positive")
    negative = grade(LABEL_MODEL, {}, sample_of("awful"), replying('{"label": "negative"}'))
    assert (negative.score, negative.passed) == (0.0, False)


def test_a_reply_cut_short_by_the_token_budget_still_gives_its_verdict():
    assert read_verdict(LABEL_MODEL, '{"label": "positive", "reasoning": "The answer is upbeat and').passed is True
    assert read_verdict(SCORE_MODEL, '{"result": 8.25, "reasoning": "Mostly right but').score == 8.25
    assert read_verdict(SCORE_MODEL, '{"result": 8.2').error is not None  # the number itself was cut: not read as 8.2


@pytest.mark.parametrize(
    "reply",
    [
        "",
        "I think it deserves a 7.",
        '{"label": "ecstatic"}',
        '{"result": "7"}',
        '{"result": NaN}',
        '{"result": 1e999}',
        '{"result": true}',
        '{"result": ' + "9" * 5000 + "}",
        "[" * 10_000,
    ],
)
def test_a_reply_without_a_verdict_is_an_error_result_with_score_zero(reply: str):
    grader = LABEL_MODEL if "label" in reply else SCORE_MODEL
    result = grade(grader, ITEM, sample_of("x"), replying(reply), pass_threshold=0.5)
    assert (result.score, result.passed) == (0.0, False)
    assert "reply" in result.details["error"]


def test_a_model_grader_without_a_judge_is_an_error_result_saying_so():
    result = grade(SCORE_MODEL, ITEM, sample_of("x"))
    assert result.score == 0.0 and result.passed is None and "no judge" in result.details["error"]


def test_an_unavailable_judge_is_an_error_result_not_a_crash():
    result = grade(LABEL_MODEL, {}, sample_of("x"), unavailable)
    assert (result.score, result.passed) == (0.0, False)
    assert "unavailable" in result.details["error"] and "no replica" in result.details["error"]


# --- multi ----------------------------------------------------------------------------------------

NAME = {**STRING_CHECK, "name": "name", "input": "{{sample.output_json.name}}", "reference": "{{item.name}}"}
EMAIL = {**STRING_CHECK, "name": "email", "input": "{{sample.output_json.email}}", "reference": "{{item.email}}"}
PERSON = {"name": "Ada", "email": "ada@example.com"}


def test_openais_documented_multi_grader_averages_its_graders():
    grader = multi({"name": NAME, "email": EMAIL}, "(name + email) / 2")
    half = grade(grader, PERSON, sample_of(json.dumps({"name": "Ada", "email": "ada@elsewhere.org"})))
    assert half.score == 0.5 and half.details["sub_scores"] == {"name": 1.0, "email": 0.0}
    assert half.passed is None
    assert grade(grader, PERSON, sample_of(json.dumps(PERSON)), pass_threshold=0.9).passed is True


def test_multi_calls_the_judge_for_each_model_grader_inside_it():
    asked: list[str] = []

    def judge(request: JudgeRequest) -> str:
        asked.append(request.model)
        return '{"label": "positive"}' if "label" in json.dumps(request.response_format) else '{"result": 4}'

    grader = multi({"quality": SCORE_MODEL, "tone": LABEL_MODEL, "name": NAME}, "quality / 10 * tone + name")
    result = grade(grader, {"name": "Ada", **ITEM}, sample_of('{"name": "Ada"}'), judge)
    assert asked == ["judge-model", "judge-model"]
    assert result.score == pytest.approx(1.4)
    assert result.details["sub_details"]["tone"] == {"label": "positive"}


def test_a_multi_grader_of_one_grader_uses_its_name_in_the_formula():
    grader = multi({**STRING_CHECK, "name": "exact"}, "exact * 0.5")
    assert grade(grader, ITEM, sample_of("fuzzy wuzzy was a bear")).score == 0.5


def test_a_formula_that_divides_by_zero_is_an_error_result_not_a_crash():
    grader = multi({"name": NAME, "email": EMAIL}, "name / email", pass_threshold=0.5)
    result = grade(grader, PERSON, sample_of(json.dumps({"name": "Ada"})))
    assert (result.score, result.passed) == (0.0, False)
    assert "divides by zero" in result.details["error"]
    assert result.details["sub_scores"] == {"name": 1.0, "email": 0.0}


def test_a_sub_graders_error_makes_the_multi_an_error_not_a_made_up_score():
    grader = multi({"quality": SCORE_MODEL, "name": NAME}, "quality + name")
    result = grade(grader, {"name": "Ada", **ITEM}, sample_of('{"name": "Ada"}'), unavailable)
    assert result.score == 0.0 and "quality" in result.details["error"]


def test_a_hostile_item_does_not_break_grading():
    deep: object = "x"
    for _ in range(10_000):
        deep = {"a": deep}
    item = {"name": deep, "email": 10**5000, "reference_answer": "y" * 100_000}
    for grader in (NAME, EMAIL, multi({"name": NAME, "email": EMAIL}, "name + email")):
        result = grade(grader, item, sample_of('{"name": "x", "email": "x@example.com"}'))
        assert isinstance(result, Result) and result.score == 0.0


def test_a_bug_in_a_grader_is_an_error_result_with_a_request_id():
    broken = {**STRING_CHECK, "operation": "unheard-of"}  # spec never keeps this; a bug could
    result = grade(broken, ITEM, sample_of("x"))
    assert result.score == 0.0 and "request id" in result.details["error"]
