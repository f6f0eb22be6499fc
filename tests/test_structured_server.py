"""Structured output and tools end to end: the ``openai`` client against ``justapi serve`` on SmolLM2 (in
process), with a ChatML template that renders tools (examples/chat_templates/chatml_tools.jinja)."""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from enum import Enum
from typing import Annotated, Literal, Optional

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from server_helpers import InProcessServer

TEMPLATE = os.path.join(os.path.dirname(__file__), "..", "examples", "chat_templates", "chatml_tools.jinja")


class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class City(BaseModel):
    name: str = Field(max_length=30)
    country: str = Field(max_length=30)


class Person(BaseModel):
    name: str = Field(max_length=30)
    age: int = Field(ge=0, le=120)


class Address(BaseModel):
    street: str = Field(max_length=40)
    city: City


class Book(BaseModel):
    title: str = Field(max_length=40)
    year: int = Field(ge=1000, le=2100)


class Models:  # twenty response formats: nested objects, arrays with bounds, enums, ranges, optional fields, $ref
    class Answer(BaseModel):
        answer: str = Field(max_length=40)

    class Flag(BaseModel):
        ok: bool

    class Score(BaseModel):
        score: float = Field(ge=0, le=10)

    class Pick(BaseModel):
        color: Color

    class Mood(BaseModel):
        mood: Literal["happy", "sad", "neutral"]

    class Count(BaseModel):
        count: int = Field(ge=1, le=5)

    class Tags(BaseModel):  # bounded items: greedy decoding of an unbounded tag ran past max_tokens on one CPU
        tags: list[Annotated[str, Field(max_length=20)]] = Field(min_length=1, max_length=3)

    class Numbers(BaseModel):
        numbers: list[int] = Field(min_length=2, max_length=4)

    class Capital(BaseModel):
        city: City

    class Family(BaseModel):
        parent: Person
        child: Person

    class Team(BaseModel):
        members: list[Person] = Field(min_length=1, max_length=2)

    class Home(BaseModel):
        owner: Person
        address: Address

    class MaybeNick(BaseModel):
        name: str = Field(max_length=20)
        nickname: Optional[str] = Field(max_length=20)

    class Weather(BaseModel):
        city: str = Field(max_length=30)
        celsius: int = Field(ge=-50, le=60)
        sky: Literal["sunny", "cloudy", "rainy"]

    class Palette(BaseModel):
        colors: list[Color] = Field(min_length=1, max_length=3)

    class Vote(BaseModel):
        option: Literal["a", "b"]
        weight: int = Field(ge=1, le=3)

    class Review(BaseModel):
        book: Book
        stars: int = Field(ge=1, le=5)

    class Point(BaseModel):
        x: float = Field(ge=-100, le=100)
        y: float = Field(ge=-100, le=100)

    class Route(BaseModel):
        start: City
        stops: list[City] = Field(max_length=2)

    class Status(BaseModel):
        code: int = Field(ge=100, le=599)
        ok: bool
        note: Optional[Literal["retry", "done"]]


MODELS = [v for k, v in vars(Models).items() if isinstance(v, type) and issubclass(v, BaseModel)]


@pytest.fixture(scope="module")
def server(real_model_path, tmp_path_factory):
    srv = InProcessServer(["--model", real_model_path, "--pool-blocks", "1024", "--served-model-name", "smol",
                           "--chat-template", TEMPLATE],
                          str(tmp_path_factory.mktemp("logs") / "structured.log"), timeout_s=300)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_parse_returns_an_object_for_every_pydantic_model(client, temperature):
    def ask(model):
        return client.chat.completions.parse(
            model="smol", messages=[{"role": "user", "content": f"Give an example of a {model.__name__}."}],
            response_format=model, temperature=temperature, seed=7, max_tokens=300)

    with ThreadPoolExecutor(len(MODELS)) as pool:  # all at once: the engine batches them
        results = list(pool.map(ask, MODELS))
    for model, r in zip(MODELS, results):
        message = r.choices[0].message
        assert r.choices[0].finish_reason == "stop", f"{model.__name__}: {message.content!r}"
        assert isinstance(message.parsed, model), f"{model.__name__}: {message.content!r}"
        jsonschema.validate(json.loads(message.content), model.model_json_schema())


def test_regex_choice_and_grammar_on_both_endpoints(server):
    url = server.url + "/v1"
    body = {"model": "smol", "max_tokens": 40, "temperature": 0.7, "seed": 3}
    cases = [({"regex": r"\d{3}-[A-Z]{2}"}, lambda t: re.fullmatch(r"\d{3}-[A-Z]{2}", t)),
             ({"choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
             ({"grammar": 'root ::= pair pair? pair? "!"\npair ::= "ab" | "ba"'},
              lambda t: re.fullmatch(r"(ab|ba){1,3}!", t))]
    for fields, ok in cases:
        chat = httpx.post(url + "/chat/completions", timeout=120, json={
            **body, "messages": [{"role": "user", "content": "Answer."}], "structured_outputs": fields, "n": 3})
        text = httpx.post(url + "/completions", timeout=120, json={
            **body, "prompt": "Answer:", "structured_outputs": fields, "n": 3})
        assert chat.status_code == 200 and text.status_code == 200, (chat.text, text.text)
        outs = [c["message"]["content"] for c in chat.json()["choices"]] + [c["text"] for c in text.json()["choices"]]
        assert all(ok(t) for t in outs), (fields, outs)


def test_bad_constraints_and_tools_are_400s_naming_the_problem(server):
    url = server.url + "/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
         "invalid JSON schema"),
        ({"structured_outputs": {"regex": "a(b"}}, "invalid regex"),
        ({"structured_outputs": {"grammar": "root ::= nowhere"}}, "invalid grammar"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "not among the tools"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "tool_call_id"),
    ]
    for extra, message in cases:
        r = httpx.post(url, json={"model": "smol", "messages": msgs, "max_tokens": 4, **extra}, timeout=60)
        assert r.status_code == 400 and message in r.json()["error"]["message"], (extra, r.text)
    ok = httpx.post(url, json={"model": "smol", "messages": msgs, "max_tokens": 4}, timeout=60)
    assert ok.status_code == 200  # the server is unharmed


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def _streamed_calls(stream) -> tuple[list[tuple[str, dict]], str]:
    names, args, reason = {}, {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        reason = choice.finish_reason or reason
        for tc in choice.delta.tool_calls or []:
            if tc.function.name:
                names[tc.index] = tc.function.name
            args[tc.index] = args.get(tc.index, "") + (tc.function.arguments or "")
    return [(names[i], json.loads(args[i])) for i in sorted(names)], reason


def test_tool_round_trip_streamed_and_not(client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        kw = dict(model="smol", messages=messages, tools=[WEATHER], tool_choice=choice, temperature=0, max_tokens=80)
        whole = client.chat.completions.create(**kw)
        calls = _calls(whole.choices[0].message)
        assert whole.choices[0].finish_reason == "tool_calls" and calls and calls[0][0] == "get_weather"
        for _, arguments in calls:
            jsonschema.validate(arguments, WEATHER["function"]["parameters"])
        streamed, reason = _streamed_calls(client.chat.completions.create(**kw, stream=True))
        assert streamed == calls and reason == "tool_calls"
    call = whole.choices[0].message.tool_calls[0]
    messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 18, "sky": "sunny"}'}]
    answer = client.chat.completions.create(model="smol", messages=messages, tools=[WEATHER], tool_choice="none",
                                            temperature=0, max_tokens=40)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    free = client.chat.completions.create(model="smol", messages=messages[:1], tools=[WEATHER], temperature=0,
                                          max_tokens=60)  # auto: whatever it answers is content or a valid call
    for _, arguments in _calls(free.choices[0].message):
        assert isinstance(arguments, dict)
