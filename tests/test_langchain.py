"""A framework over the OpenAI client (issue 55's check): langchain-openai's ChatOpenAI invokes, streams, gives
structured output and calls tools against `justapi serve`, as its docs show."""

from __future__ import annotations

from typing import Literal

import langchain_openai
from pydantic import BaseModel, Field


class Verdict(BaseModel):
    ok: bool
    score: int = Field(ge=0, le=9)


def get_weather(city: Literal["Oslo", "Paris"]) -> str:
    """The weather in a city."""
    return "sunny"


def test_chat_openai_invoke_stream_structured_output_and_tools(tiny_model, tmp_path):
    from server_helpers import InProcessServer

    srv = InProcessServer(["--model", tiny_model, "--pool-blocks", "64", "--served-model-name", "tiny"],
                          str(tmp_path / "s.log"))
    try:
        def chat_with(max_tokens: int):
            return langchain_openai.ChatOpenAI(base_url=srv.url + "/v1", api_key="x", model="tiny", temperature=0,
                                               max_tokens=max_tokens, max_retries=0)

        chat = chat_with(8)
        whole = chat.invoke("the cat")
        assert isinstance(whole.content, str) and whole.usage_metadata["output_tokens"] > 0
        assert "".join(chunk.content for chunk in chat.stream("the cat")) == whole.content
        verdict = chat_with(40).with_structured_output(Verdict, method="json_schema").invoke("judge it")
        assert isinstance(verdict, Verdict)
        tooled = chat_with(60).bind_tools([get_weather], tool_choice="get_weather").invoke("Oslo?")
        assert tooled.tool_calls[0]["name"] == "get_weather" and set(tooled.tool_calls[0]["args"]) == {"city"}
    finally:
        assert srv.stop() == 0
