"""A multi grader's calculate_output: the arithmetic OpenAI documents, and nothing a tenant could
use to run code, stall the worker or take its memory."""

from __future__ import annotations

import math
import time

import pytest

from core.graders.formula import FormulaError, calculate, formula_problem

NAMES = {"name", "email", "tone"}


def test_openais_documented_average_of_two_graders():
    # The graders guide's multigrader: two string checks averaged.
    assert formula_problem("(name + email) / 2", {"name", "email"}) is None
    assert calculate("(name + email) / 2", {"name": 1.0, "email": 0.0}) == 0.5


def test_weights_and_every_documented_function():
    scores = {"name": 0.25, "email": 1.0, "tone": 0.5}
    assert calculate("0.7 * name + 0.3 * email", scores) == pytest.approx(0.475)
    assert calculate("min(name, email, tone)", scores) == 0.25
    assert calculate("max(name, email)", scores) == 1.0
    assert calculate("abs(name - email)", scores) == 0.75
    assert calculate("floor(email * 3.5)", scores) == 3.0
    assert calculate("ceil(name * 3)", scores) == 1.0
    assert calculate("exp(0)", scores) == 1.0
    assert calculate("sqrt(name)", scores) == 0.5
    assert calculate("log(exp(tone))", scores) == pytest.approx(0.5)


def test_caret_is_power_with_powers_precedence_as_openais_guide_writes_it():
    assert calculate("tone ^ 2", {"tone": 0.5}) == 0.25
    assert calculate("2 * 3 ^ 2", {}) == 18.0
    assert calculate("-2 ^ 2", {}) == -4.0
    assert calculate("2 ** 3 + 7 // 2 + 7 % 4", {}) == 14.0


def test_a_formula_that_divides_by_zero_is_an_error_not_a_crash():
    assert formula_problem("name / (email - email)", NAMES) is None  # only its scores make it divide by zero
    with pytest.raises(FormulaError, match="divides by zero"):
        calculate("name / (email - email)", {"name": 1.0, "email": 0.5})
    with pytest.raises(FormulaError):
        calculate("name % 0", {"name": 1.0})


def test_a_tower_of_powers_is_refused_quickly_instead_of_computed():
    started = time.monotonic()
    with pytest.raises(FormulaError):
        calculate("9**9**9**9", {})
    with pytest.raises(FormulaError):
        calculate("9^9^9^9", {})
    assert time.monotonic() - started < 1.0


def test_values_that_overflow_or_leave_the_domain_are_errors():
    for formula in ("10.0 ** 400", "exp(1000)", "1e308 * 10", "sqrt(-1)", "log(0)", "(-8) ** 0.5"):
        with pytest.raises(FormulaError):
            calculate(formula, {})


def test_a_name_that_is_no_graders_is_refused_naming_the_graders():
    problem = formula_problem("name + phone", NAMES)
    assert problem is not None and "'phone'" in problem and "email, name, tone" in problem


@pytest.mark.parametrize(
    "formula",
    [
        "__import__('os')",
        "__import__('os').system('true')",
        "(lambda: 1)()",
        "name.__class__",
        "name.real",
        "[name][0]",
        "{'a': 1}",
        "'text'",
        "name if email else tone",
        "name > email",
        "name and email",
        "print(name)",
        "min",
        "min(*[name])",
        "max(name, key=abs)",
        "abs()",
        "abs(name, email)",
        "True + name",
        "1j",
        "name(1)",
        "[x for x in ()]",
        "name := 1",
        "",
        "   ",
        "name +",
        "12345678901234567890",
    ],
)
def test_anything_but_whitelisted_arithmetic_is_refused(formula: str):
    assert formula_problem(formula, NAMES) is not None
    with pytest.raises(FormulaError):
        calculate(formula, {"name": 1.0, "email": 1.0, "tone": 1.0})


def test_a_ten_thousand_character_formula_is_refused_for_its_length():
    problem = formula_problem("+".join(["name"] * 2000), NAMES)
    assert problem is not None and "characters" in problem


def test_too_many_parts_are_refused_even_within_the_length():
    problem = formula_problem("+".join(["1"] * 400), NAMES)
    assert problem is not None and "parts" in problem


def test_deeply_nested_parentheses_are_refused_not_a_crash():
    assert formula_problem("(" * 400 + "name" + ")" * 400, NAMES) is not None


def test_the_result_is_a_finite_float():
    value = calculate("name", {"name": 1})
    assert isinstance(value, float) and math.isfinite(value)
