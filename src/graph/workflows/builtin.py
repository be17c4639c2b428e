"""Registers the built-in workflows."""

from headrace.graph.workflows.dynamic import AGENT, DEBATE, ROUTER
from headrace.graph.workflows.rag import ADVANCED, NAIVE
from headrace.graph.workflows.search import CONTEXTUAL, SEARCH_GEN
from headrace.graph.workflows.summary import CHAIN, MAP_REDUCE
from headrace.graph.workflows.verify import FACT_VERIFY
from headrace.plugins.hookspecs import hookimpl

BUILTIN = (NAIVE, ADVANCED, MAP_REDUCE, CHAIN, SEARCH_GEN, CONTEXTUAL, FACT_VERIFY, DEBATE, AGENT, ROUTER)


@hookimpl
def register_workflows(register):
    for workflow in BUILTIN:
        register(workflow.name, workflow)
