"""debate and agent written as clients with the openai SDK (DyOrc's client-side baseline).

The client runs the same loop as headrace's traced workflow (src/graph/workflows/dynamic.py),
one ``/v1/chat/completions`` request per LLM call: it waits for every answer before it can
build the next prompt, so each step is a round trip, and the daemon sees one request at a
time instead of the loop's graph. Independent calls (the agents of one round) go out
concurrently, as a client would send them. Each request is one user message holding the text
headrace renders for that call (the same templates, ``PromptTemplate(...).render``), at
temperature 0 with the same token budgets; a constrained choice (the verdict, the judge's pick,
the agent's step) uses ``response_format`` ``json_schema`` with the same schema, so the daemon
constrains it as the traced call is. The agent's calculator runs in the client (headrace's own
``calculate``), as a client's tool would. Config keys, defaults and validation are headrace's own.
Nothing is retried (``max_retries=0``).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Mapping

from headrace.bench.baselines import client_validate
from headrace.bench.baselines.chaining import ClientChaining
from headrace.graph.prompts import PromptTemplate
from headrace.graph.tools import ToolError, calculate
from headrace.graph.workflow import Workflow
from headrace.graph.workflows import dynamic

WHAT = "the client-side loop baseline"
WORKFLOWS: dict[str, Workflow] = {"debate": dynamic.DEBATE, "agent": dynamic.AGENT}


def validate(workflow: str, inputs: Any, config: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    inputs, config = client_validate(WHAT, WORKFLOWS, workflow, inputs, config)
    if "collection" in inputs:
        raise ValueError("inputs.collection: the client-side agent has no search (it would need the "
                         "collection's retrieval as a client library)")
    return inputs, config


def render(prompt: str, values: Mapping[str, Any]) -> str:
    """The text headrace prefills for a traced call of ``prompt`` with these inputs."""
    return PromptTemplate(prompt).render(values)


class ClientLoops(ClientChaining):
    """debate and agent run by the client over the daemon's chat completions (same arguments as ClientChaining)."""

    async def choose(self, prompt: str, schema: Mapping[str, Any], max_tokens: int) -> Any:
        """A call constrained to ``schema`` by ``response_format``; the parsed JSON."""
        response = await self.client().chat.completions.create(
            model=self.llm, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=max_tokens,
            response_format={"type": "json_schema", "json_schema": {"name": "choice", "schema": dict(schema)}})
        return json.loads(response.choices[0].message.content or "")

    async def run(self, workflow: str, inputs: dict, config: dict) -> dict:
        inputs, config = validate(workflow, inputs, config)
        if workflow == "debate":
            return await self._debate(inputs["question"], config)
        return await self._agent(inputs["question"], config)

    async def _debate(self, question: str, config: dict[str, Any]) -> dict[str, Any]:
        n, rounds, max_tokens = config["agents"], config["rounds"], config["max_tokens"]
        personas = [dynamic.PERSONAS[i % len(dynamic.PERSONAS)] for i in range(n)]
        answers = list(await asyncio.gather(*(
            self.complete(render(dynamic.DEBATE_ANSWER.replace("{persona}", p), {"question": question}), max_tokens)
            for p in personas)))
        names = [f"a{i}" for i in range(n)]
        listed = dynamic.numbered_lines("Answer", names)
        agreed, done = False, 1
        for _ in range(1, rounds):
            if n > 1:
                prompt = render(dynamic.DEBATE_AGREE.replace("{answers}", listed),
                                {"question": question, **dict(zip(names, answers))})
                if await self.choose(prompt, {"type": "string", "enum": ["yes", "no"]}, dynamic.AGREE_TOKENS) == "yes":
                    agreed = True
                    break
            prompts = []
            for i, persona in enumerate(personas):
                others = [f"o{j}" for j in range(n) if j != i]
                template = dynamic.DEBATE_REVISE.replace("{persona}", persona).replace(
                    "{others}", dynamic.numbered_lines("Agent", others))
                prompts.append(render(template, {"question": question, "mine": answers[i],
                                                 **{f"o{j}": answers[j] for j in range(n) if j != i}}))
            answers, done = list(await asyncio.gather(*(self.complete(p, max_tokens) for p in prompts))), done + 1
        best = 0
        if n > 1:
            prompt = render(dynamic.DEBATE_JUDGE.replace("{answers}", listed),
                            {"question": question, **dict(zip(names, answers))})
            best = int(await self.choose(prompt, {"type": "string", "enum": [str(i + 1) for i in range(n)]},
                                         dynamic.JUDGE_TOKENS)) - 1
        return {"answer": answers[best], "rounds": done, "agreed": agreed, "chosen": best + 1}

    async def _agent(self, question: str, config: dict[str, Any]) -> dict[str, Any]:
        actions = [a for a in dynamic.AGENT_ACTIONS if a != "search"]
        head = dynamic.AGENT_HEAD.replace("{actions}", "; ".join(dynamic.AGENT_ACTIONS[a] for a in actions))
        transcript, values = "", {"question": question}
        steps: list[dict[str, Any]] = []
        for i in range(config["max_steps"]):
            decision = await self.choose(render(head + transcript + f"Step {i + 1}:", values),
                                         dynamic.step_schema(actions), dynamic.STEP_TOKENS)
            action, argument = decision["action"], decision["input"]
            if action == "answer":
                steps.append({"action": action, "input": argument})
                return {"answer": argument, "steps": steps}
            try:
                observation = calculate(argument)
            except ToolError as exc:
                observation = f"error: {exc}"
            values[f"act{i}"], values[f"obs{i}"] = json.dumps(decision), observation
            transcript += f"Step {i + 1}: {{{{input:act{i}}}}}\nObservation {i + 1}: {{{{input:obs{i}}}}}\n"
            steps.append({"action": action, "input": argument, "observation": observation})
        answer = await self.complete(render(head + transcript + dynamic.AGENT_FINAL, values), config["max_tokens"])
        return {"answer": answer, "steps": steps}


__all__ = ["ClientLoops", "render", "validate"]
