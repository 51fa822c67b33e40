"""The ``calculator`` tool: arithmetic parsed with :mod:`ast` and evaluated with bounds, never ``eval``.

Example:
    >>> calculator("(3 + 4) * 2")
    '14'
"""

from __future__ import annotations

import ast
import math
import operator

__all__ = ["calculator"]

_MAX_RESULT = 10**100  # |intermediate result| bound
_MAX_POWER = 1000  # |exponent| bound
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}  # fmt: skip
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > _MAX_POWER or abs(left) > _MAX_RESULT):
            raise ValueError(f"exponent {right} is too large (at most {_MAX_POWER})")
        value = _BINARY[type(node.op)](left, right)
        if isinstance(value, complex) or abs(value) > _MAX_RESULT:
            raise ValueError("the result is too large or not a real number")
        return value
    raise ValueError("only numbers and + - * / // % ** ( ) are allowed")


def calculator(expression: str) -> str:
    """Evaluate arithmetic safely: numbers, ``+ - * / // % **``, unary ``-``, parentheses; nothing else.

    Raises:
        ValueError: on anything else (names, calls, attributes...), a bound exceeded, or bad syntax.

    Example:
        >>> calculator("2 ** 10 - 7 // 2"), calculator("1 / 4")
        ('1021', '0.25')
    """
    if len(expression) > 1000:
        raise ValueError("the expression is longer than 1000 characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise ValueError(f"bad syntax ({err.msg})") from None
    except ValueError:  # ast.parse rejects NUL bytes with a ValueError in some Python versions
        raise ValueError("bad syntax (the expression contains a NUL byte)") from None
    try:
        value = _evaluate(tree)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    except OverflowError:
        raise ValueError("the result is too large or not a real number") from None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value)
