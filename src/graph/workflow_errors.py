"""The errors a workflow's lookup and input checks raise: a leaf, so every graph module may import them.

``headrace.graph.workflow`` raises them (and re-exports them); ``collection_refs`` raises
``WorkflowInputError`` too, and ``tracing`` reaches it through ``collection_refs``: with the errors
here, neither depends on ``workflow``, and ``workflow`` depends on ``tracing`` for types only.
"""

from __future__ import annotations


class WorkflowInputError(ValueError):
    def __init__(self, field_: str, problem: str) -> None:
        super().__init__(f"{field_}: {problem}")
        self.field = field_


class UnknownWorkflow(KeyError):
    def __str__(self) -> str:
        return f"no workflow named {self.args[0]!r}"
