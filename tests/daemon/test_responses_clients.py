"""Agent frameworks, unchanged, against the session's daemon (the real 135M model): the OpenAI Agents SDK with
its default Responses model and with its chat-completions model, pydantic-ai with a structured output_type,
and LangChain's ChatOpenAI on the Responses API. Where the model's free choice would decide a branch, the
request constrains it (a forced tool, a schema), so each test can fail only on the protocol."""

from __future__ import annotations

from typing import Annotated

import pytest
from pydantic import BaseModel, Field

from conftest import API_KEY

pytestmark = pytest.mark.slow

LLM = "smollm2"


class Mill(BaseModel):
    """A water mill."""

    name: str = Field(max_length=12)
    wheels: int = Field(ge=1, le=9)


@pytest.fixture(scope="module")
def agents(server):
    import agents
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)  # no trace export to OpenAI's servers
    return agents, AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


def _mill_agent(agents, model):
    calls = []

    @agents.function_tool
    def mill_height(name: Annotated[str, Field(max_length=12)]) -> str:  # bounded: the call ends within max_tokens
        """The height of a water mill's wheel, by the mill's name."""
        calls.append(name)
        return "4 metres"

    # Forced tool, and the run stops on the first tool's result: the 135M model cannot loop or wander off.
    agent = agents.Agent(name="miller", instructions="Answer with the tool.", tools=[mill_height], model=model,
                         model_settings=agents.ModelSettings(tool_choice="mill_height", temperature=0, max_tokens=48),
                         tool_use_behavior="stop_on_first_tool")
    return agent, calls


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_the_agents_sdk_runs_a_forced_tool(agents, api):
    sdk, client = agents
    model = (sdk.OpenAIResponsesModel(model=LLM, openai_client=client) if api == "responses" else
             sdk.OpenAIChatCompletionsModel(model=LLM, openai_client=client))
    agent, calls = _mill_agent(sdk, model)
    result = sdk.Runner.run_sync(agent, "How tall is the wheel of the mill called Old Ben?", max_turns=2)
    assert result.final_output == "4 metres" and len(calls) == 1
    assert sum(r.usage.input_tokens for r in result.raw_responses) > 0


def test_pydantic_ai_gives_the_structured_output_type(server):
    import pydantic_ai  # noqa: F401  (dev installs it)
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(LLM, provider=OpenAIProvider(base_url=f"{server.base_url}/v1", api_key=API_KEY))
    agent = Agent(model, output_type=Mill, model_settings={"temperature": 0, "max_tokens": 64})
    result = agent.run_sync("Invent a water mill.")
    assert isinstance(result.output, Mill)


def test_langchain_chat_openai_on_the_responses_api(server):
    import langchain_openai
    chat = langchain_openai.ChatOpenAI(model=LLM, base_url=f"{server.base_url}/v1", api_key=API_KEY, temperature=0,
                                       max_tokens=48, max_retries=0, use_responses_api=True)
    mill = chat.with_structured_output(Mill, method="json_schema").invoke("Invent a water mill.")
    assert isinstance(mill, Mill)
    ai = chat.bind_tools([Mill], tool_choice="Mill").invoke("Describe the mill called Old Ben.")
    assert len(ai.tool_calls) == 1 and ai.tool_calls[0]["name"] == "Mill"
    Mill.model_validate(ai.tool_calls[0]["args"])
