"""A multi grader's ``calculate_output``: arithmetic on its graders' scores, by a small evaluator
that walks a whitelist of syntax (no ``eval``, ``exec`` or compiled code).

What it takes is what OpenAI's graders guide lists for multigraders: numbers, the graders' names,
``+ - * /`` and ``^`` for power (``**`` too, and ``//`` and ``%``), unary ``+``/``-``, parentheses,
and the functions ``min max abs floor ceil exp sqrt log``. ``^`` is power, as in the guide, with
power's precedence (``2 * 3 ^ 2`` is 18): it is read as ``**`` before parsing (a formula has no
strings, so the replacement cannot change anything else). Nothing else parses: no attributes, no
subscripts, no other calls, no other names.

Everything is bounded so that a formula can never run long or take memory: its length, its node
count, and a power's exponent; every value is a float and must stay finite, so ``9**9**9**9`` is an
error, not a number of billions of digits.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable

MAX_FORMULA_CHARS = 1_000
MAX_NODES = 200
MAX_EXPONENT = 1_000.0  # |b| in a ** b; floats overflow far below this anyway, except near |a| = 1


class FormulaError(ValueError):
    """Why the formula has no value: the message is for the tenant."""


_BINARY: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[float], float]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS: dict[str, tuple[Callable[..., float], int | None]] = {  # name: (function, its arity; None: one or more)
    "min": (lambda *xs: min(xs), None),
    "max": (lambda *xs: max(xs), None),
    "abs": (abs, 1),
    "floor": (lambda x: float(math.floor(x)), 1),
    "ceil": (lambda x: float(math.ceil(x)), 1),
    "exp": (math.exp, 1),
    "sqrt": (math.sqrt, 1),
    "log": (math.log, 1),
}
FUNCTIONS = tuple(_FUNCTIONS)


def formula_problem(formula: str, names: set[str]) -> str | None:
    """None when ``formula`` is one this module computes from scores named ``names``; otherwise what
    to fix."""
    try:
        _parsed(formula, names)
    except FormulaError as exc:
        return str(exc)
    return None


def calculate(formula: str, scores: dict[str, float]) -> float:
    """The formula's value with each grader's name standing for its score; ``FormulaError`` when it
    has none (a division by zero, an overflow, the log of a negative number, a grader name
    ``scores`` lacks)."""
    tree = _parsed(formula, set(scores))
    try:
        value = _value(tree, scores)
    except ZeroDivisionError:
        raise FormulaError("the formula divides by zero") from None
    except OverflowError:
        raise FormulaError("the formula's value is too large to be a number") from None
    except ValueError as exc:  # math domain errors: sqrt(-1), log(0)
        raise FormulaError(f"the formula has no value: {exc}") from None
    if not math.isfinite(value):
        raise FormulaError("the formula's value is not a finite number")
    return value


def _parsed(formula: str, names: set[str]) -> ast.expr:
    if not isinstance(formula, str) or not formula.strip():
        raise FormulaError("the formula is empty")
    if len(formula) > MAX_FORMULA_CHARS:
        raise FormulaError(f"the formula has {len(formula):,} characters; at most {MAX_FORMULA_CHARS:,} are allowed")
    try:
        tree = ast.parse(formula.replace("^", "**"), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise FormulaError("the formula is not arithmetic this platform reads (a syntax error)") from None
    nodes = list(ast.walk(tree))
    if len(nodes) > MAX_NODES:
        raise FormulaError(f"the formula has {len(nodes)} parts; at most {MAX_NODES} are allowed")
    callees = {id(node.func) for node in nodes if isinstance(node, ast.Call)}
    for node in nodes:
        _check(node, names, called=id(node) in callees)
    return tree


def _check(node: ast.AST, names: set[str], called: bool) -> None:
    """Refuse any node the evaluator does not compute (``ast.walk`` visits the children itself);
    ``called``: the node is what a call calls, where a function's name belongs."""
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise FormulaError(f"the formula holds {node.value!r}; it may hold only numbers")
        if isinstance(node.value, int) and abs(node.value) > 10**15:
            raise FormulaError("the formula holds an integer with more than 15 digits")
    elif isinstance(node, ast.Name):
        if called:
            return  # the Call node checks its function's name
        if node.id in _FUNCTIONS and node.id not in names:
            raise FormulaError(f"{node.id} is a function: call it, {node.id}(...)")
        if node.id not in names:
            known = ", ".join(sorted(names)) or "none"
            raise FormulaError(f"the formula names {node.id!r}, which is no grader's name (the graders: {known})")
    elif isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name) or node.func.id not in _FUNCTIONS or node.keywords:
            raise FormulaError(f"the formula calls something other than the functions {', '.join(FUNCTIONS)}")
        arity = _FUNCTIONS[node.func.id][1]
        if (arity is not None and len(node.args) != arity) or not node.args:
            raise FormulaError(f"{node.func.id}() takes {arity or 'one or more'} argument(s)")
        if any(isinstance(argument, ast.Starred) for argument in node.args):
            raise FormulaError("the formula unpacks arguments with *; name each one")
    elif isinstance(node, ast.expr_context):
        pass
    elif isinstance(node, ast.BinOp):
        if type(node.op) not in _BINARY:
            raise FormulaError("the formula uses an operator other than + - * / // % ^ **")
    elif isinstance(node, ast.UnaryOp):
        if type(node.op) not in _UNARY:
            raise FormulaError("the formula uses a unary operator other than + and -")
    elif not isinstance(node, (ast.operator, ast.unaryop)):
        raise FormulaError(f"the formula holds a {type(node).__name__} expression; only arithmetic is allowed")


def _value(node: ast.expr, scores: dict[str, float]) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):  # _check allowed no other
        return float(node.value)
    if isinstance(node, ast.Name):
        return float(scores[node.id])
    if isinstance(node, ast.UnaryOp):
        return _UNARY[type(node.op)](_value(node.operand, scores))
    if isinstance(node, ast.BinOp):
        left, right = _value(node.left, scores), _value(node.right, scores)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise FormulaError(f"the formula raises to the power {right:g}; at most {MAX_EXPONENT:g} is allowed")
        result = _BINARY[type(node.op)](left, right)
        if isinstance(result, complex):  # a negative number to a fractional power
            raise FormulaError("the formula raises a negative number to a fractional power")
        return _finite(result)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        function = _FUNCTIONS[node.func.id][0]
        return _finite(float(function(*(_value(argument, scores) for argument in node.args))))
    raise FormulaError("the formula holds something other than arithmetic")  # _check refused it already


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise FormulaError("the formula's value is not a finite number (it overflows)")
    return value
