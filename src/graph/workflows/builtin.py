"""Registers the built-in workflows."""

from headrace.graph.workflows.rag import ADVANCED, NAIVE
from headrace.plugins.hookspecs import hookimpl

BUILTIN = (NAIVE, ADVANCED)


@hookimpl
def register_workflows(register):
    for workflow in BUILTIN:
        register(workflow.name, workflow)
