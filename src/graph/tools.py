"""The safe built-in tools a traced workflow may call (``trace.tool(name, argument)``).

A tool is a plain function of one argument that returns text; it runs as a function primitive
on the event loop, so it must be quick and must not reach outside the process. An argument it
cannot use raises ``ToolError``, whose message is meant for the model to read.
"""

from __future__ import annotations

import ast
import operator
from typing import Any, Callable


class ToolError(ValueError):
    """A tool's argument it cannot use (the message says why, for the model to read)."""


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64  # 10 ** 10 ** 10 would take the event loop's CPU for hours
MAX_MAGNITUDE = 1e30


def calculate(expression: Any) -> str:
    """Arithmetic on numbers (+ - * / // % **, parentheses), parsed by Python's parser into a tree
    whose every node is checked: no names, calls or attributes, so nothing but arithmetic runs."""
    text = str(expression).strip().strip("`").strip()
    if not text or len(text) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expected an arithmetic expression of 1-{MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text.replace("^", "**").replace("×", "*").replace("÷", "/"), mode="eval")
    except SyntaxError:
        raise ToolError(f"not an arithmetic expression: {text!r}") from None

    def value(node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
                raise ToolError(f"exponent {right} is too large (at most {MAX_EXPONENT})")
            try:
                result = _BINARY[type(node.op)](left, right)
            except ZeroDivisionError:
                raise ToolError("division by zero") from None
            if isinstance(result, complex) or abs(result) > MAX_MAGNITUDE:
                raise ToolError("the result is out of range")
            return result
        raise ToolError(f"only numbers and + - * / // % ** are allowed, not {type(node).__name__}")

    result = value(tree.body)
    if isinstance(result, float) and result.is_integer():
        result = int(result)
    return str(round(result, 10) if isinstance(result, float) else result)


TOOLS: dict[str, Callable[[Any], str]] = {"calculator": calculate}
