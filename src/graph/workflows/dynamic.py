"""The built-in traced workflows: debate, agent and router (DyOrc §4's dynamic applications).

Each is an ``async def`` over a ``Trace`` (``headrace.graph.tracing``): its engine calls
return handles, and it awaits one only where Python decides something (do the agents
agree, which action or route the model chose). What it passes on unawaited (an answer
into the next round's prompts, a search's hits into the answer's prompt) is an edge of
the run's graph, so the next call is issued, and its ready prefix prefilled, before the
value exists.

- debate: ``agents`` agents answer (each with its own persona), then, round by round,
  read the others' answers and revise, for at most ``rounds`` rounds; after each round
  but the last the LLM is asked whether they agree (constrained to yes/no), and a yes
  stops early. A judge (constrained to the agents' numbers) picks the answer.
- agent: a ReAct loop. Each step the model writes ``{"action", "input"}``, constrained
  to JSON of that schema: ``search`` the run's collection, ``calculate`` with the safe
  calculator, or ``answer``. An observation goes into the next step's prompt as a handle.
  After ``max_steps`` steps without an answer, a last call answers from what it found.
- router: the model classifies the question, constrained to the routes on offer, and
  the run takes that sub-workflow: ``direct`` (answer), ``search`` (retrieve from the
  collection, then answer from it) or ``compute`` (write an arithmetic expression,
  constrained to a pattern, calculate it, answer with the result).
"""

from __future__ import annotations

import json
from typing import Any

from headrace.graph.tracing import CallFailed, Handle, Trace
from headrace.graph.workflow import Workflow, WorkflowInputError
from headrace.graph.workflows.common import COLLECTION, QUESTION, SHORT_ANSWER_MAX_TOKENS, max_tokens_option

MAX_TOKENS = max_tokens_option(SHORT_ANSWER_MAX_TOKENS)
RETRIEVAL_KINDS = ("llm", "embed", "vector_store")


def numbered_lines(prefix: str, names: list[str]) -> str:
    """``prefix 1: {{input:a}}`` lines, one per variable name."""
    return "".join(f"{prefix} {i + 1}: {{{{input:{name}}}}}\n" for i, name in enumerate(names))


# debate --------------------------------------------------------------------------------------

PERSONAS = ("a careful scientist", "a practical engineer", "a skeptical historian", "a patient teacher",
            "a curious student", "a concise journalist")
DEBATE_ANSWER = "Question: {{input:question}}\nYou are {persona}. Answer the question in one or two sentences.\nAnswer:"
DEBATE_REVISE = ("Question: {{input:question}}\nYou are {persona}. Your answer was: {{input:mine}}\n"
                 "Other agents answered:\n{others}"
                 "Considering their answers, give your final answer in one or two sentences.\nAnswer:")
DEBATE_AGREE = ("Question: {{input:question}}\n{answers}"
                "Do all these answers say the same thing? Reply yes or no.\nSame:")
DEBATE_JUDGE = "Question: {{input:question}}\n{answers}Which answer is the best? Reply with its number.\nBest:"
AGREE_TOKENS = 4  # '"yes"' with room to spare; the constraint ends it
JUDGE_TOKENS = 4


async def debate(t: Trace) -> dict[str, Any]:
    question, n, rounds, max_tokens = t.inputs["question"], t.config["agents"], t.config["rounds"], t.config["max_tokens"]
    personas = [PERSONAS[i % len(PERSONAS)] for i in range(n)]
    answers: list[Handle] = [
        t.llm.generate(DEBATE_ANSWER.replace("{persona}", persona), inputs={"question": question},
                       max_tokens=max_tokens, name="agent")  # one name: a round's agents are a task group
        for persona in personas]
    agreed, done = False, 1
    for r in range(1, rounds):
        if n > 1:  # do they agree already? the only value this round needs in Python
            names = [f"a{i}" for i in range(n)]
            verdict = t.llm.generate(DEBATE_AGREE.replace("{answers}", numbered_lines("Answer", names)),
                                     inputs={"question": question, **dict(zip(names, answers))},
                                     choices=["yes", "no"], max_tokens=AGREE_TOKENS, name="agree")
            if await verdict == "yes":
                agreed = True
                break
        revised = []
        for i, persona in enumerate(personas):
            others = [f"o{j}" for j in range(n) if j != i]
            prompt = DEBATE_REVISE.replace("{persona}", persona).replace("{others}", numbered_lines("Agent", others))
            values = {"question": question, "mine": answers[i], **{f"o{j}": answers[j] for j in range(n) if j != i}}
            revised.append(t.llm.generate(prompt, inputs=values, max_tokens=max_tokens, name="agent"))
        answers, done = revised, r + 1
    best = 0
    if n > 1:
        names = [f"a{i}" for i in range(n)]
        pick = t.llm.generate(DEBATE_JUDGE.replace("{answers}", numbered_lines("Answer", names)),
                              inputs={"question": question, **dict(zip(names, answers))},
                              choices=[str(i + 1) for i in range(n)], max_tokens=JUDGE_TOKENS, name="judge")
        best = int(await pick) - 1
    return {"answer": await answers[best], "rounds": done, "agreed": agreed, "chosen": best + 1}


DEBATE = Workflow(
    name="debate",
    description="DyOrc's DEBATE: agents answer, read each other's answers and revise for up to `rounds` rounds, "
                "stopping early once the LLM finds they agree; a judge picks the answer. Traced.",
    inputs={"question": QUESTION},
    required=("question",),
    config={"agents": {"type": "integer", "minimum": 1, "maximum": len(PERSONAS), "default": 3},
            "rounds": {"type": "integer", "minimum": 1, "maximum": 5, "default": 3,
                       "description": "rounds of answers, the first included"},
            "max_tokens": MAX_TOKENS},
    outputs=("answer", "rounds", "agreed", "chosen"),
    trace=debate,
)


# agent ---------------------------------------------------------------------------------------

AGENT_HEAD = ("You answer a question step by step. At each step reply with JSON: {actions}. "
              "Give the answer once the observations hold it.\nQuestion: {{input:question}}\n")
AGENT_ACTIONS = {
    "search": '{"action": "search", "input": "<a search query>"} to search the documents',
    "calculate": '{"action": "calculate", "input": "<arithmetic such as 12 * (3 + 4)>"} to compute',
    "answer": '{"action": "answer", "input": "<the answer>"}',
}
AGENT_FINAL = "Answer the question in one sentence from the observations.\nAnswer:"
MAX_ACTION_INPUT = 80  # characters: a query, an expression or a short answer
# Room for the whole step JSON even at one token a character (digits are): a cut-off step would not
# parse. The constraint ends a shorter one early, so the bound costs nothing.
STEP_TOKENS = 128


def step_schema(actions: list[str]) -> dict[str, Any]:
    """The JSON a step must be: which action, and its input."""
    return {"type": "object",
            "properties": {"action": {"type": "string", "enum": actions},
                           "input": {"type": "string", "minLength": 1, "maxLength": MAX_ACTION_INPUT}},
            "required": ["action", "input"], "additionalProperties": False}


async def agent(t: Trace) -> dict[str, Any]:
    question, config = t.inputs["question"], t.config
    actions = [a for a in AGENT_ACTIONS if a in config["actions"] and (a != "search" or "collection" in t.inputs)]
    head = AGENT_HEAD.replace("{actions}", "; ".join(AGENT_ACTIONS[a] for a in actions))
    transcript, values = "", {"question": question}
    steps: list[dict[str, Any]] = []
    for i in range(config["max_steps"]):
        decision = await t.llm.generate(head + transcript + f"Step {i + 1}:", inputs=values,
                                        schema=step_schema(actions), max_tokens=STEP_TOKENS, name="step")
        action, argument = decision["action"], decision["input"]
        if action == "answer":
            steps.append({"action": action, "input": argument})
            return {"answer": argument, "steps": await _observed(steps)}
        if action == "search":
            observation: Any = t.search(argument, k=config["k"], name="search")
        else:
            observation = t.tool("calculator", argument)
            try:  # a bad expression is an observation too: the model may write a better one
                await observation
            except CallFailed as exc:
                observation = f"error: {exc}"
        # The observation goes into the next step's prompt as it is: a search's hits are not awaited here.
        values[f"act{i}"], values[f"obs{i}"] = json.dumps(decision), observation
        transcript += f"Step {i + 1}: {{{{input:act{i}}}}}\nObservation {i + 1}: {{{{input:obs{i}}}}}\n"
        steps.append({"action": action, "input": argument, "observation": observation})
    final = t.llm.generate(head + transcript + AGENT_FINAL, inputs=values, max_tokens=config["max_tokens"],
                           stream=True, name="final")
    return {"answer": await final, "steps": await _observed(steps)}


async def _observed(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The steps with each observation's text (a search's hits were passed on unawaited)."""
    for step in steps:
        if isinstance(step.get("observation"), Handle):
            step["observation"] = await step["observation"].text()
    return steps


def check_actions(inputs: dict[str, Any], config: dict[str, Any]) -> None:
    if set(config["actions"]) == {"search"} and "collection" not in inputs:
        raise WorkflowInputError("config.actions", "'search' needs inputs.collection to search")


AGENT = Workflow(
    name="agent",
    description="A ReAct loop: each step the LLM (constrained to a JSON step) searches the collection, calculates "
                "with the safe calculator, or answers; at most `max_steps` steps. Traced.",
    inputs={"question": QUESTION, "collection": COLLECTION},
    required=("question",),
    config={"max_steps": {"type": "integer", "minimum": 1, "maximum": 16, "default": 4},
            "k": {"type": "integer", "minimum": 1, "maximum": 16, "default": 2, "description": "chunks per search"},
            "actions": {"type": "array", "items": {"type": "string", "enum": list(AGENT_ACTIONS)}, "minItems": 1,
                        "default": list(AGENT_ACTIONS),
                        "description": "what a step may do (OpenAI's tool_choice): [\"calculate\"] forces the "
                                       "calculator; search needs inputs.collection"},
            "max_tokens": MAX_TOKENS},
    outputs=("answer", "steps"),
    kinds=RETRIEVAL_KINDS,
    trace=agent,
    check=check_actions,
)


# router --------------------------------------------------------------------------------------

ROUTES = {"direct": "a general question to answer directly",
          "search": "a question about the documents",
          "compute": "an arithmetic problem"}
ROUTE = "Question: {{input:question}}\nWhich kind of question is it? {choices}\nKind:"
DIRECT = "Answer the question in one or two sentences.\nQuestion: {{input:question}}\nAnswer:"
FROM_CONTEXT = ("Answer the question using the context.\nQuestion: {{input:question}}\n"
                "Context:\n{{input:context}}\nAnswer:")
EXPRESSION = "Write the arithmetic expression that answers the question.\nQuestion: {{input:question}}\nExpression:"
WITH_RESULT = ("Answer the question in one sentence.\nQuestion: {{input:question}}\n"
               "The calculation {{input:expression}} = {{input:result}}\nAnswer:")
ARITHMETIC = r"^[0-9(][0-9+\-*/%(). ]{0,39}$"  # what the expression may hold: the calculator's alphabet
EXPRESSION_TOKENS = 48  # the quoted expression even at one token a character
ROUTE_TOKENS = 6


async def _direct(t: Trace, question: str) -> Handle:
    return t.llm.generate(DIRECT, inputs={"question": question}, max_tokens=t.config["max_tokens"], stream=True,
                          name="answer")


async def _search(t: Trace, question: str) -> Handle:
    hits = t.search(question, k=t.config["k"], name="search")
    # Issued with the hits unawaited: the answer's prompt up to the context is prefilled during the search.
    return t.llm.generate(FROM_CONTEXT, inputs={"question": question, "context": hits},
                          max_tokens=t.config["max_tokens"], stream=True, name="answer")


async def _compute(t: Trace, question: str) -> Handle:
    expression = t.llm.generate(EXPRESSION, inputs={"question": question}, max_tokens=EXPRESSION_TOKENS,
                                schema={"type": "string", "pattern": ARITHMETIC}, name="expression")
    result: Any = t.tool("calculator", expression)
    try:
        await result
    except CallFailed as exc:
        result = f"not computable ({exc})"
    return t.llm.generate(WITH_RESULT, inputs={"question": question, "expression": expression, "result": result},
                          max_tokens=t.config["max_tokens"], stream=True, name="answer")


SUB_WORKFLOWS = {"direct": _direct, "search": _search, "compute": _compute}


async def router(t: Trace) -> dict[str, Any]:
    question = t.inputs["question"]
    routes = [r for r in ROUTES if r != "search" or "collection" in t.inputs]
    route = t.config["route"]
    if route == "auto":
        choices = "; ".join(f"{r}: {ROUTES[r]}" for r in routes)
        route = await t.llm.generate(ROUTE.replace("{choices}", choices), inputs={"question": question},
                                     choices=routes, max_tokens=ROUTE_TOKENS, name="route")
    answer = await SUB_WORKFLOWS[route](t, question)
    return {"answer": await answer, "route": route}


def check_route(inputs: dict[str, Any], config: dict[str, Any]) -> None:
    if config["route"] == "search" and "collection" not in inputs:
        raise WorkflowInputError("config.route", "'search' needs inputs.collection to search")


ROUTER = Workflow(
    name="router",
    description="The LLM classifies the question (constrained to the routes), then the run takes that sub-workflow: "
                "answer directly, retrieve from the collection and answer, or compute and answer. Traced.",
    inputs={"question": QUESTION, "collection": COLLECTION},
    required=("question",),
    config={"route": {"type": "string", "enum": ["auto", *ROUTES], "default": "auto",
                      "description": "auto: the LLM classifies; else this route is taken"},
            "k": {"type": "integer", "minimum": 1, "maximum": 16, "default": 2, "description": "chunks per search"},
            "max_tokens": MAX_TOKENS},
    outputs=("answer", "route"),
    kinds=RETRIEVAL_KINDS,
    trace=router,
    check=check_route,
)

DYNAMIC = (DEBATE, AGENT, ROUTER)
