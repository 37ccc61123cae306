"""The built-in example tool: arithmetic on numbers, evaluated by walking Python's syntax tree.

What it deliberately is not: `eval`. Only numbers, + - * / // % ** and parentheses are read; a name, a call,
an attribute or anything else is refused, and so is a power whose result would be too large to compute. Numbers
are read as a word problem writes them ("$1,200", "3 × 4"): Python would read "1,200 * 3" as a pair.
"""

from __future__ import annotations

import ast
import math
import operator
import re

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_DIGITS = 1000  # a power whose result would have more digits is refused: 9**9**9 would stall the tool
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")  # the comma of 1,200 (not of "1, 2")
_SIGNS = str.maketrans({"$": None, "\u00d7": "*", "\u00f7": "/", "\u2212": "-"})  # $, times, divide, minus


def calculator(expression: str) -> int | float:
    """Evaluate an arithmetic expression.

    Args:
        expression: numbers with + - * / // % ** and parentheses, for example "(3 + 4) * 2.5".

    Returns:
        The value of the expression.
    """
    try:
        tree = ast.parse(_THOUSANDS.sub("", expression.translate(_SIGNS)).strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"{expression!r} is not an arithmetic expression") from None
    value = _evaluate(tree.body)
    return int(value) if isinstance(value, float) and value.is_integer() and abs(value) < 2**53 else value


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            _refuse_a_huge_power(left, right)
        return _BINARY[type(node.op)](left, right)
    raise ValueError(f"{ast.unparse(node)!r} is not allowed: only numbers, + - * / // % ** and parentheses")


def _refuse_a_huge_power(base: int | float, exponent: int | float) -> None:
    if abs(base) > 1 and exponent > 0 and exponent * math.log10(abs(base)) > MAX_DIGITS:
        raise ValueError(f"{base!r} ** {exponent!r} is too large (more than {MAX_DIGITS} digits)")
