"""A tenant's grader checked as OpenAI's types have it: what is kept, and the 400 that names the
field to fix."""

from __future__ import annotations

import pytest

from core.api_errors import ApiError
from core.graders.spec import MAX_LABELS, MAX_MESSAGES, checked_grader, judge_models, sub_graders

# The graders guide's string_check example.
STRING_CHECK = {
    "type": "string_check",
    "name": "Example string check grader",
    "input": "{{sample.output_text}}",
    "reference": "{{item.reference_answer}}",
    "operation": "eq",
}
SCORE_MODEL = {
    "type": "score_model",
    "name": "Example score model grader",
    "input": [
        {
            "role": "user",
            "content": "Score how close the reference answer is to the model answer. Score 1.0 if they are the same "
            "and 0.0 if they are different. Return just a floating point score\n\nReference answer: "
            "{{item.reference_answer}}\n\nModel answer: {{sample.output_text}}",
        }
    ],
    "model": "judge-model",
    "sampling_params": {"temperature": 1, "top_p": 1, "seed": 42},
}
LABEL_MODEL = {
    "type": "label_model",
    "name": "sentiment",
    "model": "judge-model",
    "input": [
        {"role": "developer", "content": "Classify the sentiment of the answer."},
        {"role": "user", "content": [{"type": "input_text", "text": "{{sample.output_text}}"}]},
    ],
    "labels": ["positive", "neutral", "negative"],
    "passing_labels": ["positive"],
}


def refusal(raw: object, param: str = "grader", **kwargs: bool) -> ApiError:
    with pytest.raises(ApiError) as caught:
        checked_grader(raw, param, **kwargs)
    assert caught.value.status == 400
    return caught.value


def test_openais_documented_string_check_is_kept_as_given():
    assert checked_grader(STRING_CHECK, "grader") == STRING_CHECK


def test_openais_documented_score_model_is_kept_with_the_default_range():
    kept = checked_grader(SCORE_MODEL, "grader")
    assert kept["range"] == [0.0, 1.0]
    assert kept["sampling_params"] == {"temperature": 1.0, "top_p": 1.0, "seed": 42}
    assert kept["input"] == SCORE_MODEL["input"]


def test_a_label_model_with_text_parts_is_kept():
    assert checked_grader(LABEL_MODEL, "grader") == LABEL_MODEL


def test_an_unknown_field_is_refused_naming_it_and_the_fields_there_are():
    error = refusal({**STRING_CHECK, "case_sensitive": True})
    assert error.code == "invalid_grader" and error.param == "grader.case_sensitive"
    assert "operation" in error.message


def test_the_param_is_the_callers_prefix_then_the_field():
    error = refusal({**STRING_CHECK, "input": "{{answer}}"}, "testing_criteria.0")
    assert error.param == "testing_criteria.0.input"
    assert "namespace" in error.message


def test_a_missing_field_is_named():
    error = refusal({key: value for key, value in STRING_CHECK.items() if key != "reference"})
    assert error.param == "grader.reference" and "required" in error.message


def test_types_are_strict():
    assert refusal({**STRING_CHECK, "input": 5}).param == "grader.input"
    assert refusal({**STRING_CHECK, "operation": "contains"}).param == "grader.operation"
    assert refusal({**SCORE_MODEL, "range": ["0", "1"]}).param == "grader.range.0"
    assert refusal({**SCORE_MODEL, "range": [False, True]}).param == "grader.range.0"


def test_not_an_object_or_an_unknown_type_is_refused():
    assert refusal("string_check").param == "grader"
    assert refusal({"type": "regex"}).param == "grader.type"
    assert refusal({"name": "x"}).param == "grader.type"


def test_python_graders_are_not_offered_and_the_message_says_what_to_use():
    error = refusal({"type": "python", "name": "p", "source": "def grade(sample, item):\n    return 1.0"})
    assert error.code == "grader_not_offered" and error.param == "grader.type"
    assert "sandbox" in error.message
    for offered in ("string_check", "text_similarity", "score_model", "label_model", "multi"):
        assert offered in error.message


def test_cosine_similarity_is_not_offered_and_the_message_names_the_metrics_that_are():
    error = refusal(
        {"type": "text_similarity", "name": "t", "input": "a", "reference": "b", "evaluation_metric": "cosine"}
    )
    assert error.code == "grader_not_offered" and error.param == "grader.evaluation_metric"
    assert "embedding" in error.message and "fuzzy_match" in error.message and "rouge" in error.message


def test_images_in_a_model_graders_input_are_refused_by_name():
    image = {"type": "input_image", "image_url": "https://example.com/cat.png"}
    error = refusal({**SCORE_MODEL, "input": [{"role": "user", "content": [image]}]})
    assert error.param == "grader.input.0.content" and "input_image" in error.message


def test_nan_and_infinity_are_refused_in_range_and_pass_threshold():
    assert refusal({**SCORE_MODEL, "range": [0, float("nan")]}).param == "grader.range.1"
    assert refusal({**SCORE_MODEL, "range": [float("-inf"), 1]}).param == "grader.range.0"
    with_threshold = {**SCORE_MODEL, "pass_threshold": float("inf")}
    assert refusal(with_threshold, pass_threshold=True).param == "grader.pass_threshold"
    similarity = {"type": "text_similarity", "name": "t", "input": "a", "reference": "b", "evaluation_metric": "bleu"}
    assert refusal({**similarity, "pass_threshold": float("nan")}, pass_threshold=True).param == "grader.pass_threshold"


def test_a_thousand_digit_integer_is_refused_not_a_crash():
    assert refusal({**SCORE_MODEL, "range": [0, 10**1000]}).param == "grader.range.1"
    sampling = {"seed": 10**1000}
    assert refusal({**SCORE_MODEL, "sampling_params": sampling}).param == "grader.sampling_params.seed"


def test_a_range_must_increase():
    assert refusal({**SCORE_MODEL, "range": [1, 1]}).param == "grader.range"
    assert refusal({**SCORE_MODEL, "range": [0, 1, 2]}).param == "grader.range"


@pytest.mark.parametrize(
    "sampling, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"seed": -1}, "seed"),
        ({"max_completions_tokens": 0}, "max_completions_tokens"),
        ({"max_completions_tokens": 10**6}, "max_completions_tokens"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"max_tokens": 5}, "max_tokens"),
    ],
)
def test_sampling_params_out_of_range_are_refused(sampling: dict, field: str):
    assert refusal({**SCORE_MODEL, "sampling_params": sampling}).param == f"grader.sampling_params.{field}"


def test_length_caps():
    assert refusal({**STRING_CHECK, "reference": "x" * 10_001}).param == "grader.reference"
    assert refusal({**STRING_CHECK, "name": "n" * 65}).param == "grader.name"
    assert refusal({**STRING_CHECK, "name": ""}).param == "grader.name"
    assert refusal({**LABEL_MODEL, "labels": ["l" * 101], "passing_labels": ["l" * 101]}).param == "grader.labels.0"
    many = [f"label{i}" for i in range(MAX_LABELS + 1)]
    assert refusal({**LABEL_MODEL, "labels": many, "passing_labels": many[:1]}).param == "grader.labels"
    messages = [{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1)
    assert refusal({**SCORE_MODEL, "input": messages}).param == "grader.input"
    assert refusal({**SCORE_MODEL, "input": []}).param == "grader.input"
    long_content = [{"role": "user", "content": "x" * 10_001}]
    assert refusal({**SCORE_MODEL, "input": long_content}).param == "grader.input.0.content"


def test_a_hundred_thousand_character_field_is_refused_quickly():
    assert refusal({**STRING_CHECK, "input": "{{item.a}}" * 10_000}).param == "grader.input"


def test_label_model_labels_must_be_distinct_and_passing_labels_among_them():
    assert refusal({**LABEL_MODEL, "labels": ["a", "a"], "passing_labels": ["a"]}).param == "grader.labels"
    error = refusal({**LABEL_MODEL, "passing_labels": ["great"]})
    assert error.param == "grader.passing_labels" and "'great'" in error.message
    assert refusal({**LABEL_MODEL, "passing_labels": []}).param == "grader.passing_labels"


def test_template_injection_in_a_message_is_refused_naming_the_message():
    messages = [
        {"role": "user", "content": "ok"},
        {"role": "user", "content": "{{ item.__class__.__mro__[1] | attr }}"},
    ]
    assert refusal({**SCORE_MODEL, "input": messages}).param == "grader.input.1.content"


def test_a_message_role_must_be_openais():
    assert refusal({**SCORE_MODEL, "input": [{"role": "tool", "content": "x"}]}).param == "grader.input.0.role"


MULTI = {
    "type": "multi",
    "name": "name and email",
    "graders": {
        "name": {**STRING_CHECK, "name": "name", "input": "{{sample.output_json.name}}", "reference": "{{item.name}}"},
        "email": {
            **STRING_CHECK,
            "name": "email",
            "input": "{{sample.output_json.email}}",
            "reference": "{{item.email}}",
        },
    },
    "calculate_output": "(name + email) / 2",
}


def test_openais_documented_multi_grader_of_named_graders_is_kept():
    kept = checked_grader(MULTI, "grader")
    assert kept == MULTI
    assert set(sub_graders(kept)) == {"name", "email"}


def test_a_multi_grader_of_one_grader_as_the_clients_type_has_it_is_kept():
    one = {"type": "multi", "name": "one", "graders": STRING_CHECK, "calculate_output": "2 * name"}
    error = refusal(one)  # the formula names the one grader by its name
    assert error.param == "grader.calculate_output"
    one = {**one, "graders": {**STRING_CHECK, "name": "exact"}, "calculate_output": "2 * exact"}
    assert sub_graders(checked_grader(one, "grader")) == {"exact": one["graders"]}


def test_a_nested_graders_problem_is_named_by_its_key():
    bad = {**MULTI, "graders": {**MULTI["graders"], "email": {**STRING_CHECK, "reference": "{{email}}"}}}
    assert refusal(bad).param == "grader.graders.email.reference"


def test_recursive_multi_is_refused_naming_the_field():
    nested = {**MULTI, "graders": {"inner": MULTI}, "calculate_output": "inner"}
    error = refusal(nested)
    assert error.param == "grader.graders.inner.type" and "multi" in error.message


def test_a_python_grader_inside_multi_is_not_offered():
    inner = {"type": "python", "name": "p", "source": "def grade(s, i): return 1"}
    error = refusal({**MULTI, "graders": {"p": inner}, "calculate_output": "p"})
    assert error.code == "grader_not_offered" and error.param == "grader.graders.p.type"


def test_a_formula_naming_no_grader_or_doing_more_than_arithmetic_is_refused():
    assert refusal({**MULTI, "calculate_output": "name + phone"}).param == "grader.calculate_output"
    assert refusal({**MULTI, "calculate_output": "__import__('os')"}).param == "grader.calculate_output"


def test_a_multi_graders_keys_must_be_names_a_formula_can_use():
    bad = {**MULTI, "graders": {"my grader": STRING_CHECK}, "calculate_output": "1"}
    assert refusal(bad).param == "grader.graders.my grader"


def test_pass_threshold_only_in_the_evals_form_and_only_where_openai_has_one():
    similarity = {"type": "text_similarity", "name": "t", "input": "a", "reference": "b", "evaluation_metric": "bleu"}
    assert refusal({**similarity, "pass_threshold": 0.5}).param == "grader.pass_threshold"  # the fine-tuning form
    assert checked_grader({**similarity, "pass_threshold": 0.5}, "c", pass_threshold=True)["pass_threshold"] == 0.5
    assert refusal(similarity, pass_threshold=True).param == "grader.pass_threshold"  # required there
    assert refusal({**STRING_CHECK, "pass_threshold": 1}, pass_threshold=True).param == "grader.pass_threshold"
    assert "pass_threshold" not in checked_grader(SCORE_MODEL, "c", pass_threshold=True)  # optional
    assert checked_grader({**MULTI, "pass_threshold": 0.5}, "c", pass_threshold=True)["pass_threshold"] == 0.5


def test_a_score_models_pass_threshold_must_lie_within_its_range():
    graded = {**SCORE_MODEL, "range": [0, 10], "pass_threshold": 11}
    assert refusal(graded, pass_threshold=True).param == "grader.pass_threshold"
    assert checked_grader({**graded, "pass_threshold": 7}, "c", pass_threshold=True)["pass_threshold"] == 7


def test_judge_models_lists_every_model_grader_with_its_field():
    assert judge_models(checked_grader(SCORE_MODEL, "g")) == [("model", "judge-model")]
    assert judge_models(checked_grader(STRING_CHECK, "g")) == []
    combined = {
        "type": "multi",
        "name": "m",
        "graders": {"quality": SCORE_MODEL, "tone": {**LABEL_MODEL, "model": "other-judge"}, "exact": STRING_CHECK},
        "calculate_output": "quality * tone + exact",
    }
    assert judge_models(checked_grader(combined, "g")) == [
        ("graders.quality.model", "judge-model"),
        ("graders.tone.model", "other-judge"),
    ]
    one = {"type": "multi", "name": "m", "graders": {**SCORE_MODEL, "name": "q"}, "calculate_output": "q"}
    assert judge_models(checked_grader(one, "g")) == [("graders.model", "judge-model")]
