"""OpenAI's {{item.x}} / {{sample.x}} grader templates: what they render, and what they refuse."""

from __future__ import annotations

from core.graders.template import MAX_RENDERED_CHARS, substitute, template_problem


def test_openais_documented_string_check_templates_render_the_item_and_the_sample():
    # The graders guide's string_check example: input {{sample.output_text}}, reference {{item.reference_answer}}.
    item = {"reference_answer": "fuzzy wuzzy was a bear"}
    sample = {"output_text": "fuzzy wuzzy was a bear"}
    assert template_problem("{{item.reference_answer}}") is None
    assert template_problem("{{sample.output_text}}") is None
    assert substitute("{{item.reference_answer}}", item, sample) == "fuzzy wuzzy was a bear"
    assert substitute("Model answer: {{sample.output_text}}!", item, sample) == "Model answer: fuzzy wuzzy was a bear!"


def test_whitespace_inside_the_braces_is_allowed():
    assert template_problem("{{ item.answer }}") is None
    assert substitute("[{{ item.answer }}]", {"answer": "42"}, None) == "[42]"


def test_nested_paths_reach_into_objects_and_lists():
    item = {"answer": {"steps": ["first", {"value": 7}]}}
    assert substitute("{{item.answer.steps.0}}", item, None) == "first"
    assert substitute("{{item.answer.steps[1].value}}", item, None) == "7"
    assert substitute("{{sample.output_json.city}}", {}, {"output_json": {"city": "Paris"}}) == "Paris"


def test_non_string_values_render_as_compact_json():
    item = {"n": 3, "ok": True, "list": [1, "a"], "obj": {"é": None}}
    assert substitute("{{item.n}} {{item.ok}} {{item.list}} {{item.obj}}", item, None) == '3 true [1,"a"] {"é":null}'


def test_a_missing_value_renders_as_empty_text_not_an_error():
    assert substitute("<{{item.absent}}>", {}, None) == "<>"
    assert substitute("<{{item.list.5}}>", {"list": [1]}, None) == "<>"
    assert substitute("<{{item.text.0}}>", {"text": "abc"}, None) == "<>"  # a string is not indexed
    assert substitute("<{{sample.output_text}}>", {"x": 1}, None) == "<>"  # no sample at all


def test_python_attributes_are_just_missing_keys():
    item = {"reference": "x"}
    assert template_problem("{{item.__class__}}") is None  # a valid path: it names a key the item lacks
    assert substitute("{{item.__class__}}", item, None) == ""
    assert substitute("{{item.__init__.__globals__}}", item, None) == ""
    assert substitute("{{item.reference.__class__.__name__}}", item, None) == ""
    assert substitute("{{sample.output_text.upper}}", item, {"output_text": "abc"}) == ""


def test_a_key_named_like_an_attribute_is_read_as_data():
    assert substitute("{{item.__class__}}", {"__class__": "data"}, None) == "data"


def test_an_unknown_namespace_is_a_problem_that_names_the_namespaces():
    problem = template_problem("Answer: {{answer.text}}")
    assert problem is not None and "item and sample" in problem


def test_expressions_and_filters_are_not_templates():
    for text in ("{{item.a + 1}}", "{{item.a | upper}}", "{{item['a']}}", "{{item.a()}}", "{{}}", "{{ item. }}"):
        assert template_problem(text) is not None, text


def test_a_whole_namespace_is_a_problem():
    assert template_problem("{{item}}") is not None


def test_an_unclosed_brace_pair_is_a_problem():
    assert template_problem("{{item.a}} and then {{item.b") is not None


def test_plain_text_without_templates_is_fine_and_unchanged():
    text = 'Reply with {"score": 1} only.'
    assert template_problem(text) is None
    assert substitute(text, {}, None) == text


def test_a_template_repeating_a_large_field_is_cut_at_the_cap():
    item = {"big": "x" * 100_000}
    rendered = substitute("{{item.big}}" * 1000, item, None)
    assert len(rendered) == MAX_RENDERED_CHARS


def test_deeply_nested_item_data_renders_without_crashing():
    deep: object = "bottom"
    for _ in range(5000):
        deep = [deep]
    assert substitute("<{{item.deep}}>", {"deep": deep}, None) == "<>"  # too deep to write as JSON: missing
    assert substitute("{{item.ok}}", {"deep": deep, "ok": "fine"}, None) == "fine"


def test_a_thousands_of_digits_integer_renders_without_crashing():
    assert substitute("{{item.n}}", {"n": 10**1000}, None) == "1" + "0" * 1000
    assert substitute("<{{item.n}}>", {"n": 10**5000}, None) == "<>"  # past Python's int-to-text limit


def test_a_non_finite_float_renders_as_missing():
    assert substitute("<{{item.x}}>", {"x": float("nan")}, None) == "<>"
