"""Property-based fuzzing of every route (issue 53): whatever a client sends, the server answers without a 5xx,
every 4xx carries OpenAI's error body (``{"error": {"message": str, "type": str, "param": ..., "code": ...}}``),
every event stream it starts ends in ``[DONE]`` with no server error inside, and it still serves afterwards.

Three fuzzers share one server (the tiny random model with a chat template that renders tools, on loopback, in
this process):

- schemathesis, driven by the app's OpenAPI schema (the one the server serves): every GET and POST route, with
  its coverage cases (boundary values, missing and mistyped fields, unexpected methods) and hypothesis-generated
  requests, valid and invalid;
- hypothesis strategies for what the schema leaves open (``response_format``, ``structured_outputs``, ``tools``,
  ``tool_choice``, content parts, tool calls): valid bodies with a field or two off (NaN and infinities as
  Python's json writes them, floats past float32, integers past 64 bits, lone surrogates, special tokens, malformed
  schemas, regexes and grammars), so that most requests get past validation into the engine;
- a sweep: each field of a valid request at each edge value of its type, one at a time.

Requests stay cheap without hiding any input: the server's context is the tiny model's 1024 tokens and ``n`` at
most 2, so whatever ``max_tokens`` a request asks for, it either fits (a second at most on the tiny model) or is
refused; the hypothesis bodies mostly ask for a few tokens. A request unanswered within REQUEST_TIMEOUT_S is a
failure, and once the server stops answering at all every later request fails at once, naming the one that hung
it. Failures are told apart by the server's traceback: hypothesis shrinks and reports each distinct one, the sweep
lists them all. The run is derandomized (fixed seeds), so CI sends the same requests every time;
``JUSTAPI_FUZZ_EXAMPLES=500`` raises the generated requests per route (10) for a long local run.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
import time

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server_helpers import InProcessServer
from tiny_gguf import vocab as tiny_vocab

KEY = "fuzz-key"
NAME = "tiny"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN = 1024  # the tiny model's context: room for the tools template's ~400 tokens of preamble
SERVER_SETTINGS = dict(api_key=KEY, served_model_name=NAME, max_n=2)
EXAMPLES = int(os.environ.get("JUSTAPI_FUZZ_EXAMPLES", "10"))  # generated requests per route and fuzzer
SEED = 53  # issue 53
TOOLS_TEMPLATE = os.path.join(os.path.dirname(__file__), "..", "examples", "chat_templates", "chatml_tools.jinja")
REQUEST_TIMEOUT_S = 30  # unanswered after this long is a failure (the tiny model needs < 1 s, a first grammar ~6)


# --- the server, and what every answer must satisfy ---------------------------------------------------------------


class ServerErrors(logging.Handler):
    """The tracebacks the server logs (uvicorn's "Exception in ASGI application", the app's own handlers), so that
    a failure is reported with its cause."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.guard = threading.Lock()  # not ``lock``: that is logging.Handler's own, held around emit()
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if record.exc_info:
            text += "\n" + logging.Formatter().formatException(record.exc_info)
        with self.guard:
            self.records.append(text)

    def take(self, wait_s: float = 0.0) -> str:
        """What was logged since the last call; waiting up to ``wait_s`` for something to be (uvicorn logs an
        exception after its 500 has been sent)."""
        deadline = time.monotonic() + wait_s
        while not self.records and time.monotonic() < deadline:
            time.sleep(0.02)
        with self.guard:
            out, self.records = self.records, []
        return "\n".join(out)


_FAILURE_KINDS: dict[str, type] = {}


def failure(key: str, message: str) -> AssertionError:
    """An AssertionError of a class of its own per cause ``key``: hypothesis tells failures apart by their class
    and shrinks and reports each on its own, instead of only the first bug it meets."""
    if key not in _FAILURE_KINDS:
        _FAILURE_KINDS[key] = type(f"FuzzFailure{len(_FAILURE_KINDS) + 1}", (AssertionError,), {"cause": key})
    return _FAILURE_KINDS[key](f"[{key}]\n{message}")


def _cause(server_log: str, fallback: str) -> str:
    """A failure's cause for telling bugs apart: the innermost frame of the project's code in the server's
    traceback and the exception's type, else ``fallback``."""
    frames = re.findall(r'File "[^"]*/(justapi/[^"]+)", line (\d+), in (\S+)', server_log)
    raised = re.findall(r"^(\w[\w.]*(?:Error|Exception|Exit|Interrupt)\b)", server_log, flags=re.M)
    if frames:
        path, line, func = frames[-1]
        return f"{fallback} at {path}:{line} ({func}){': ' + raised[-1] if raised else ''}"
    return fallback


# how the last event of a family's stream ends it (Anthropic's Messages, OpenAI's Responses, llama.cpp's /infill)
TYPED_ENDS = {"anthropic": lambda e: e.get("type") == "message_stop",
              "responses": lambda e: e.get("type") in ("response.completed", "response.incomplete"),
              "infill": lambda e: e.get("stop") is True}


def answer_problems(status: int, content_type: str, content: bytes, cut_short: bool = False,
                    family: str = "openai") -> list[tuple[str, str]]:
    """What is wrong with one answer, as (kind, description): a 5xx, a 4xx without its family's error body
    (OpenAI's; Ollama's {"error": str}; Anthropic's {"type": "error", "error": {"type", "message"}}), a stream
    that breaks off or carries a server error, a 200 that is not what it says; [] when nothing is."""
    text = content.decode("utf-8", "backslashreplace")
    if status >= 500:
        return [(f"{status}", f"{status} (a server error): {text[:2000]}")]
    if 400 <= status < 500:
        try:
            body = json.loads(content)
        except ValueError:
            return [(f"{status} not JSON", f"{status} whose body is not JSON ({content_type!r}): {text[:2000]}")]
        err = body.get("error") if isinstance(body, dict) else None
        if family == "ollama":
            ok = isinstance(err, str) and err and set(body) == {"error"}
            return [] if ok else [(f"{status} not Ollama's error body", f"{status} without {{\"error\": str}}: "
                                   f"{text[:2000]}")]
        if family == "anthropic":
            ok = body.get("type") == "error" and isinstance(err, dict) and isinstance(err.get("message"), str) \
                and isinstance(err.get("type"), str)
            return [] if ok else [(f"{status} not Anthropic's error body", f"{status} without Anthropic's error "
                                   f"body: {text[:2000]}")]
        if not (isinstance(err, dict) and isinstance(err.get("message"), str) and err["message"]
                and isinstance(err.get("type"), str) and "param" in err and "code" in err):
            return [(f"{status} not OpenAI's error body", f"{status} without OpenAI's error body {{\"error\": "
                     f"{{\"message\": str, \"type\": str, \"param\": ..., \"code\": ...}}}}: {text[:2000]}")]
        if not content_type.startswith("application/json"):
            return [(f"{status} not application/json", f"{status} error body served as {content_type!r}")]
        return []
    if status == 200 and content_type.startswith("text/event-stream") and not cut_short and family in TYPED_ENDS:
        lines = re.split(r"\r\n|\r|\n", text)
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
        if not events or not TYPED_ENDS[family](events[-1]):
            bad = events[-1] if events else text[-2000:]
            return [("typed stream not ended", f"a {family} event stream whose last event does not end it: "
                     f"{str(bad)[:2000]}")]
    elif status == 200 and content_type.startswith("text/event-stream") and not cut_short:
        lines = re.split(r"\r\n|\r|\n", text)  # an event stream's only line ends (not str.splitlines' U+0085 ...)
        events = [line[6:] for line in lines if line.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            return [("stream without [DONE]", f"an event stream that does not end in [DONE]: ...{text[-2000:]}")]
        for data in events[:-1]:
            try:
                payload = json.loads(data)
            except ValueError:
                return [("stream event not JSON", f"an event that is not JSON: {data[:2000]}")]
            err = payload.get("error") if isinstance(payload, dict) else None
            if err is not None and (not isinstance(err, dict) or not isinstance(err.get("code"), int)
                                    or err["code"] >= 500 or not isinstance(err.get("message"), str)):
                return [("stream with a server error", f"an event stream carrying a server error: {data[:2000]}")]
    elif status == 200 and content_type.startswith("application/json"):
        try:
            json.loads(content)
        except ValueError:
            return [("200 not JSON", f"a 200 whose JSON body does not parse: {text[:2000]}")]
    return []


class FuzzedServer:
    """The server under fuzzing: its URL, the tracebacks it logs, and whether it has stopped answering."""

    def __init__(self, srv: InProcessServer, errors: ServerErrors) -> None:
        self.srv, self.url, self.errors = srv, srv.url, errors
        self.hung_by: str | None = None  # the request after which the server answered nothing, not even /health

    def before(self) -> None:
        if self.hung_by is not None:
            raise failure("server hung", f"the server stopped answering after {self.hung_by}")
        self.errors.take()

    def check(self, request: str, status: int, content_type: str, content: bytes, cut_short: bool = False) -> None:
        path = request.split(" ", 2)[1].split("?")[0] if request.count(" ") else ""
        family = ("ollama" if path.startswith("/api/") else "anthropic" if path.startswith("/v1/messages") else
                  "responses" if path.startswith("/v1/responses") else "infill" if path == "/infill" else "openai")
        problems = answer_problems(status, content_type, content, cut_short, family)
        server_log = self.errors.take(wait_s=2.0 if status >= 500 else 0.0)
        if problems:
            kind, _ = problems[0]
            message = f"{request}\n  -> " + "\n  -> ".join(p for _, p in problems)
            if server_log:
                message += f"\nthe server logged:\n{_trimmed(server_log)}"
            raise failure(_cause(server_log, kind), message)

    def no_answer(self, request: str, exc: BaseException) -> None:
        server_log = self.errors.take(wait_s=1.0)
        message = f"{request}\n  -> no complete answer: {exc!r}"
        if server_log:
            message += f"\nthe server logged:\n{_trimmed(server_log)}"
        try:
            alive = httpx.get(self.url + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            alive = False
        if not alive:
            self.hung_by = message
        raise failure(_cause(server_log, f"no answer ({type(exc).__name__})"), message)


@pytest.fixture(scope="module")
def fuzz_server(tiny_model, tmp_path_factory):
    errors = ServerErrors()
    logging.getLogger().addHandler(errors)
    log = tmp_path_factory.mktemp("fuzz_logs") / "server.log"
    srv = InProcessServer(["--model", tiny_model, "--served-model-name", NAME, "--api-key", KEY,
                           "--max-n", str(SERVER_SETTINGS["max_n"]), "--max-model-len", str(MAX_MODEL_LEN),
                           "--pool-blocks", "128", "--threads", "1", "--chat-template", TOOLS_TEMPLATE], str(log))
    try:
        yield FuzzedServer(srv, errors)
    finally:
        logging.getLogger().removeHandler(errors)
        assert srv.stop() == 0, "the server should shut down cleanly after the fuzzing"


def _trimmed(server_log: str) -> str:
    """A server log cut to what tells the cause: each traceback's frames in the project's code and its error."""
    out = []
    for line in server_log.splitlines():
        if line.startswith("  File ") and "/justapi/" not in line:
            out.append(None)  # a frame outside the project: dropped, with the code line under it
        elif out and out[-1] is None and line.startswith("    "):
            continue
        else:
            out.append(line)
    text = "\n".join(line for line in out if line is not None)
    return text if len(text) <= 6000 else "...\n" + text[-6000:]


def _shown(method: str, path: str, body: bytes | str | None) -> str:
    if isinstance(body, bytes):
        body = body.decode("utf-8", "backslashreplace")
    if body is not None and len(body) > 3000:
        body = body[:3000] + "..."
    return f"{method} {path}" + (f" {body}" if body else "")


# --- schemathesis: every route of the OpenAPI schema --------------------------------------------------------------


def _openapi() -> dict:
    """The app's OpenAPI schema, built (not served: no engine loads) with the fuzzed server's settings; a test
    checks that the server serves this very schema."""
    from justapi.server_config import ServerConfig
    from justapi.server.api import build_app

    return build_app(ServerConfig(**SERVER_SETTINGS), NAME, lambda: None).openapi()


OPENAPI = _openapi()
api = schemathesis.openapi.from_dict(OPENAPI, config=schemathesis.Config.from_dict({
    "seed": SEED,
    "suppress-health-check": ["all"],
    "headers": AUTH,
    "request-timeout": REQUEST_TIMEOUT_S,
    # a completion's stream is read to its end (and [DONE] checked); the dashboard's never ends: two events of it
    "max-stream-events": 4 * MAX_MODEL_LEN,
    "operations": [{"include-path": "/dashboard/events", "max-stream-events": 2}],
    "generation": {"mode": "all", "max-examples": EXAMPLES, "deterministic": True, "database": "none"},
    "phases": {"examples": {"enabled": True}, "coverage": {"enabled": True}, "fuzzing": {"enabled": True},
               "stateful": {"enabled": False}},
}))


def test_the_schema_is_the_served_one_with_every_route(fuzz_server):
    assert httpx.get(fuzz_server.url + "/openapi.json", headers=AUTH, timeout=30).json() == OPENAPI
    routes = {(method.upper(), path) for path, ops in OPENAPI["paths"].items() for method in ops}
    assert {method for method, _ in routes} == {"GET", "POST", "HEAD"}  # HEAD: Ollama's "/", its CLI's probe
    assert routes >= {("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/v1/embeddings"),
                      ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/v1/models"), ("GET", "/health"),
                      ("GET", "/metrics"), ("GET", "/engine/steps"), ("GET", "/dashboard/events")}


@api.parametrize()
@settings(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
def test_every_route_of_the_openapi_schema(case, fuzz_server):
    """Every GET and POST route of /openapi.json fuzzed by schemathesis (examples, coverage cases and generated
    ones, valid and invalid): no 5xx, OpenAI error bodies, streams that end in [DONE]."""
    fuzz_server.before()
    try:
        response = case.call(base_url=fuzz_server.url, timeout=REQUEST_TIMEOUT_S)
    except requests.RequestException as e:
        body = e.request.body if getattr(e, "request", None) is not None else None
        fuzz_server.no_answer(_shown(case.method, case.formatted_path, body), e)
    shown = _shown(case.method, response.request.path_url, response.request.body)
    fuzz_server.check(shown, response.status_code, ";".join(response.headers.get("content-type", [""])),
                      response.content, response.stream_cut_short)


# --- hypothesis: what the schema cannot say -----------------------------------------------------------------------

BIG_INTS = [-(2**63) - 1, -(2**31), -1, 0, 2**31, 2**53 + 1, 2**63, 2**64, 10**30]
EDGE_FLOATS = [0.0, -0.0, 5e-324, 1e-300, 1e-40, 1e-6, 1e10, 1e39, 1e300, 1.7976931348623157e308, -1.0, -1e300,
               math.nan, math.inf, -math.inf]  # 1e-40 and 1e39: past float32's normal range, 1e-300: past all of it
VOCAB = len(tiny_vocab()[0])  # the tiny model's: ids below it are valid
TOOL_NAMES = ["get_weather", "f", "a-b_c"]

texts = st.text(max_size=24)
words = st.text(st.characters(codec="ascii", categories=["L", "N"]), min_size=1, max_size=8)
odd_texts = st.one_of(
    st.sampled_from(["", " ", "<|im_end|>", "<|endoftext|>", "<|im_start|>user\n", "{{ 7*7 }}", "{% raw %}", "\x00",
                     "\ufffd", "\U0001f600", "\u202e", "\u2028", "a" * 600]),
    st.text(st.characters(categories=["Cs"]), min_size=1, max_size=3),  # lone surrogates: valid JSON escapes
    st.text(st.characters(categories=["Cc", "Co", "Cn", "Zl"]), min_size=1, max_size=4),
)
odd_ints = st.one_of(st.sampled_from(BIG_INTS), st.integers())
odd_floats = st.one_of(st.sampled_from(EDGE_FLOATS), st.floats())
json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 300), odd_ints, st.floats(), texts, odd_texts)
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.one_of(words, odd_texts), inner, max_size=3)), max_leaves=8)


def rarely(valid, odd):
    """Mostly ``valid``, one time in eight ``odd`` (hypothesis shrinks towards ``valid``): for the parts of a
    field, so that a field's value is usually off in one place at most."""
    return st.one_of(*[valid] * 7, odd)


def ints(lo: int, hi: int):
    return rarely(st.integers(lo, hi), odd_ints)


# JSON schemas (response_format, structured_outputs, a tool's parameters): well-formed ones, and ones off somewhere
_schema_leaves = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "number", "boolean", "null"])}),
    st.fixed_dictionaries({"type": st.just("string")}, optional={
        "pattern": st.sampled_from(["^[a-z]+$", "\\d+", "[A-Z][a-z]*"]), "minLength": st.integers(0, 3),
        "maxLength": st.integers(3, 9), "format": st.sampled_from(["date", "date-time", "email", "uuid", "ipv4"])}),
    st.fixed_dictionaries({"type": st.sampled_from(["integer", "number"])}, optional={
        "minimum": st.integers(-5, 0), "maximum": st.integers(1, 9), "multipleOf": st.sampled_from([1, 2, 0.5])}),
    st.fixed_dictionaries({"enum": st.lists(st.one_of(words, st.integers(-3, 3)), min_size=1, max_size=3,
                                            unique=True)}),
    st.fixed_dictionaries({"const": st.one_of(words, st.integers(-3, 3), st.booleans())}),
)
_odd_schema_leaves = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["bogus", "", "object", "array"])}),
    st.fixed_dictionaries({"type": st.just("string")}, optional={
        "pattern": st.sampled_from(["(", "a{3,1}", "[^\\x00]*", "\\p{L}", "(?=a)", "a**"]), "minLength": odd_ints,
        "maxLength": odd_ints, "format": st.sampled_from(["nope", ""])}),
    st.fixed_dictionaries({"type": st.sampled_from(["integer", "number"])}, optional={
        "minimum": st.one_of(odd_ints, odd_floats), "maximum": st.one_of(odd_ints, odd_floats),
        "multipleOf": odd_floats}),
    st.fixed_dictionaries({"enum": st.lists(json_scalars, max_size=3)}),
    st.fixed_dictionaries({"$ref": st.sampled_from(["#", "#/$defs/nope", "#/properties/a",
                                                    "http://127.0.0.1:1/schema.json"])}),
    st.booleans(),
    json_values,
)


def _schema_nest(inner):
    names = rarely(st.sampled_from(["a", "name", "age"]), st.one_of(words, odd_texts))
    return st.one_of(
        st.fixed_dictionaries({"type": st.just("object"), "properties": st.dictionaries(names, inner, max_size=3)},
                              optional={"required": st.lists(st.sampled_from(["a", "name", "age"]), max_size=3,
                                                             unique=True),
                                        "additionalProperties": st.booleans()}),
        st.fixed_dictionaries({"type": st.just("array"), "items": inner}, optional={
            "minItems": st.integers(0, 2), "maxItems": st.integers(2, 4)}),
        st.fixed_dictionaries({"anyOf": st.lists(inner, min_size=1, max_size=3)}),
    )


schemas = st.recursive(_schema_leaves, _schema_nest, max_leaves=5)
odd_schemas = st.recursive(rarely(_schema_leaves, _odd_schema_leaves), lambda inner: st.one_of(
    _schema_nest(inner), st.fixed_dictionaries({st.sampled_from(["oneOf", "allOf", "not", "$defs", "items"]): inner}),
    st.fixed_dictionaries({"type": st.just("object"), "properties": json_values, "required": json_values})),
    max_leaves=5).filter(lambda s: s != {})
object_schemas = st.fixed_dictionaries({"type": st.just("object"), "properties": st.dictionaries(
    st.sampled_from(["city", "n", "when"]), schemas, max_size=2)}, optional={"required": st.just(["city"])})

regexes = st.sampled_from(["[a-z]{1,5}", "(yes|no)", "\\d{3}-\\d{4}", "[A-Z][a-z]*", "x"])
odd_regexes = st.one_of(st.sampled_from(["(", "[", "\\", "a{100000}", "(?=a)", "(?<x>a)\\k<x>", "\\p{L}+", "",
                                         ".*", "a**", "[z-a]"]), odd_texts, json_values)
grammars = st.sampled_from(['root ::= "yes" | "no"', "root ::= [a-z]+", 'root ::= "a" root?'])
odd_grammars = st.one_of(st.sampled_from(["root ::= root", "root ::=", 'x ::= "a"', "", "root ::= [", "::="]),
                         odd_texts, json_values)

response_formats = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
    st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries(
        {"name": st.sampled_from(["answer", "x"]), "schema": schemas}, optional={"strict": st.booleans()})}),
)
odd_response_formats = st.one_of(
    st.fixed_dictionaries({"type": st.one_of(st.sampled_from(["json_schema", "bogus", ""]), json_values)}),
    st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": st.one_of(json_values, st.fixed_dictionaries(
        {}, optional={"name": json_values, "schema": odd_schemas, "strict": json_values}))}),
    json_values,
)
structured_outputs = st.one_of(
    st.fixed_dictionaries({"json": st.one_of(schemas, schemas.map(json.dumps))}),
    st.fixed_dictionaries({"regex": regexes}),
    st.fixed_dictionaries({"choice": st.lists(words, min_size=1, max_size=4)}),
    st.fixed_dictionaries({"grammar": grammars}),
    st.fixed_dictionaries({"json_object": st.just(True)}),
)
odd_structured_outputs = st.one_of(
    st.fixed_dictionaries({"json": st.one_of(odd_schemas, odd_schemas.map(json.dumps), odd_texts)}),
    st.fixed_dictionaries({"regex": odd_regexes}),
    st.fixed_dictionaries({"choice": st.one_of(st.lists(rarely(words, odd_texts), max_size=4), json_values)}),
    st.fixed_dictionaries({"grammar": odd_grammars}),
    st.fixed_dictionaries({"json_object": json_values}),
    st.dictionaries(st.sampled_from(["json", "regex", "choice", "grammar", "json_object", "other"]),
                    st.one_of(schemas, regexes, grammars, json_values), min_size=2, max_size=3),
    json_values,
)

tool_names = rarely(st.sampled_from(TOOL_NAMES), st.one_of(words, odd_texts, json_values))
tools = st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(TOOL_NAMES)}, optional={"description": texts, "parameters": object_schemas})}),
    min_size=1, max_size=3, unique_by=lambda t: t["function"]["name"])
odd_tools = st.one_of(st.lists(st.fixed_dictionaries({"type": rarely(st.just("function"), json_values),
                                                     "function": rarely(st.fixed_dictionaries(
                                                         {"name": tool_names}, optional={
                                                             "description": rarely(texts, json_values),
                                                             "parameters": rarely(object_schemas, odd_schemas)}),
                                                         json_values)}), max_size=3), json_values)
tool_choices = st.one_of(st.sampled_from(["none", "auto", "required"]), st.fixed_dictionaries(
    {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.sampled_from(TOOL_NAMES)})}))
odd_tool_choices = st.one_of(st.sampled_from(["any", "", "function", "REQUIRED"]), json_values, st.fixed_dictionaries(
    {"type": rarely(st.just("function"), json_values), "function": rarely(st.fixed_dictionaries(
        {"name": tool_names}), json_values)}))

text_parts = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}), min_size=1, max_size=3)
odd_parts = st.lists(rarely(st.fixed_dictionaries({"type": st.just("text"), "text": texts}), st.one_of(
    st.fixed_dictionaries({"type": st.just("text")}),
    st.fixed_dictionaries({"type": st.just("text"), "text": st.one_of(odd_texts, json_values)}),
    st.fixed_dictionaries({"type": st.sampled_from(["image_url", "input_audio", "file", "refusal", "bogus"])},
                          optional={"image_url": st.fixed_dictionaries({"url": texts}), "text": texts,
                                    "refusal": texts}),
    st.dictionaries(st.sampled_from(["type", "text", "image_url"]), json_values, max_size=3),
)), max_size=3)
contents = st.one_of(texts, text_parts)
odd_contents = st.one_of(st.none(), odd_texts, odd_parts, json_values)
plain_messages = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "developer"]),
                                        "content": contents})
tool_turns = st.fixed_dictionaries({"name": st.sampled_from(TOOL_NAMES), "arguments": st.dictionaries(
    st.sampled_from(["city", "n"]), st.one_of(words, st.integers()), max_size=2)}).map(lambda call: [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": call["name"],
                                                               "arguments": json.dumps(call["arguments"])}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
messages = st.tuples(st.lists(plain_messages, min_size=1, max_size=3), st.one_of(st.just([]), tool_turns)).map(
    lambda parts: parts[0] + parts[1])
odd_roles = st.one_of(st.sampled_from(["function", "bogus", ""]), json_values)
roles = st.sampled_from(["user", "assistant", "tool", "system"])
odd_message = st.fixed_dictionaries({"role": rarely(roles, odd_roles)},
                                    optional={"content": rarely(contents, odd_contents),
                                              "name": rarely(words, st.one_of(odd_texts, json_values)),
                                              "tool_calls": st.one_of(st.lists(json_values, max_size=2), json_values,
                                                                      tool_turns.map(lambda t: t[0]["tool_calls"])),
                                              "tool_call_id": rarely(words, json_values),
                                              "refusal": texts, "reasoning_content": texts})
odd_messages = st.one_of(st.lists(rarely(plain_messages, odd_message), max_size=4), json_values)


def id_lists(max_size: int = 6):
    return st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=max_size)


odd_id_lists = st.one_of(st.lists(rarely(st.integers(0, VOCAB - 1), st.one_of(odd_ints, st.integers(VOCAB, 2**16))),
                                  max_size=6), st.lists(st.integers(0, VOCAB - 1), min_size=300, max_size=300))
prompts = st.one_of(texts.filter(bool), st.lists(texts.filter(bool), min_size=1, max_size=2), id_lists(),
                    st.lists(id_lists(), min_size=1, max_size=2))
odd_prompts = st.one_of(odd_texts, st.lists(rarely(texts, odd_texts), max_size=3), odd_id_lists,
                        st.lists(odd_id_lists, max_size=3), json_values)

# name: (valid values, odd values) of each request field
SAMPLING = {
    "model": (st.just(NAME), st.one_of(st.sampled_from(["gpt-4o", "", NAME.upper()]), odd_texts, json_values)),
    # valid: a few tokens (a request without one runs to the end of the context: the sweep and schemathesis send
    # those); odd: none, zero, negative, past the context, past 64 bits
    "max_tokens": (st.integers(1, 8), st.one_of(st.none(), st.integers(-2, MAX_MODEL_LEN + 2), odd_ints)),
    "temperature": (st.one_of(st.none(), st.floats(0, 2)), odd_floats),
    "top_p": (st.one_of(st.none(), st.floats(0.01, 1)), odd_floats),
    "top_k": (st.one_of(st.none(), st.integers(-1, 50)), st.one_of(st.integers(-3, 2 * VOCAB), odd_ints)),
    "min_p": (st.one_of(st.none(), st.floats(0, 1)), odd_floats),
    "n": (st.integers(1, 2), st.one_of(st.integers(-1, 3), odd_ints)),
    "stop": (st.one_of(st.none(), words, st.lists(words, max_size=3)),
             st.one_of(odd_texts, st.lists(rarely(texts, odd_texts), max_size=20), json_values)),
    "stop_token_ids": (st.lists(st.integers(0, VOCAB - 1), max_size=3), st.one_of(odd_id_lists, json_values)),
    "seed": (st.one_of(st.none(), st.integers(0, 2**32)), odd_ints),
    "presence_penalty": (st.one_of(st.none(), st.floats(-2, 2)), odd_floats),
    "frequency_penalty": (st.one_of(st.none(), st.floats(-2, 2)), odd_floats),
    "repetition_penalty": (st.sampled_from([None, 1.0]), odd_floats),
    "stream": (st.booleans(), json_values),
    "stream_options": (st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                           "continuous_usage_stats": st.booleans()}), json_values),
    "ignore_eos": (st.booleans(), json_values),
    "skip_special_tokens": (st.booleans(), json_values),
    "speculative": (st.booleans(), json_values),
    "user": (words, st.one_of(odd_texts, json_values)),
    "priority": (st.integers(-10, 10), odd_ints),
    "timeout": (st.floats(0.5, 30), odd_floats),
    "logit_bias": (st.sampled_from([None, {}]), st.dictionaries(st.one_of(words, odd_texts), odd_floats, max_size=2)),
    "best_of": (st.sampled_from([None, 1]), st.one_of(st.integers(-1, 3), odd_ints)),
    "response_format": (response_formats, odd_response_formats),
    "structured_outputs": (structured_outputs, odd_structured_outputs),
}
FIELDS = {  # each route's fields; the first are required
    "/v1/chat/completions": ({"messages": (messages, odd_messages), "max_tokens": SAMPLING["max_tokens"]}, {
        **SAMPLING, "max_completion_tokens": SAMPLING["max_tokens"],
        "logprobs": (st.booleans(), json_values), "top_logprobs": (st.integers(0, 5), st.one_of(
            st.integers(-2, 30), odd_ints)),
        "add_generation_prompt": (st.booleans(), json_values), "tools": (tools, odd_tools),
        "tool_choice": (tool_choices, odd_tool_choices),
        "parallel_tool_calls": (st.one_of(st.none(), st.booleans()), json_values)}),
    "/v1/completions": ({"prompt": (prompts, odd_prompts), "max_tokens": SAMPLING["max_tokens"]}, {
        **SAMPLING, "logprobs": (st.one_of(st.none(), st.integers(0, 5)), st.one_of(st.integers(-2, 30), odd_ints)),
        "echo": (st.booleans(), json_values), "suffix": (st.none(), st.one_of(texts, odd_texts))}),
    "/v1/embeddings": ({"input": (prompts, odd_prompts)}, {
        "model": SAMPLING["model"], "user": SAMPLING["user"], "timeout": SAMPLING["timeout"],
        "encoding_format": (st.sampled_from(["float", "base64"]), json_values),
        "dimensions": (st.one_of(st.none(), st.integers(1, 64)), st.one_of(st.integers(-2, 80), odd_ints))}),
    "/tokenize": ({}, {
        "model": SAMPLING["model"], "prompt": (texts, st.one_of(odd_texts, json_values)),
        "messages": (messages, odd_messages), "add_special_tokens": (st.booleans(), json_values),
        "add_generation_prompt": (st.booleans(), json_values)}),
    "/detokenize": ({"tokens": (id_lists(12), st.one_of(odd_id_lists, json_values))}, {"model": SAMPLING["model"]}),
}


@st.composite
def bodies(draw, path: str):
    """A request body for ``path``: its required fields and a few optional ones, all valid but for at most two
    (none about one time in three), which take odd values: "each field at its edges, combined"."""
    required, optional = FIELDS[path]
    names = list(required) + draw(st.lists(st.sampled_from(sorted(set(optional) - set(required))), unique=True,
                                           max_size=6))
    odd = draw(st.one_of(st.just([]), st.lists(st.sampled_from(names), min_size=1, max_size=2, unique=True))) \
        if names else []
    fields = required | optional
    return {name: draw(fields[name][1] if name in odd else fields[name][0]) for name in names}


@pytest.mark.parametrize("path", list(FIELDS))
def test_openai_fields_the_schema_leaves_open(fuzz_server, path):
    """Bodies with what the OpenAPI schema types only as "object" or "any" filled in the way OpenAI clients (and
    broken ones) fill them, and a field or two at an edge (NaN and infinities as Python's json writes them, floats
    past float32, integers past 64 bits, lone surrogates, special tokens, malformed schemas, regexes, grammars,
    tools and content parts): the same answers required as of the schemathesis run."""
    headers = {**AUTH, "Content-Type": "application/json"}

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(body=bodies(path))
    def fuzz(body):
        fuzz_server.before()
        content = json.dumps(body).encode()  # allow_nan: NaN and Infinity as Python writes them
        shown = _shown("POST", path, content)
        try:  # a connection of its own: none left half-closed by an earlier answer
            r = httpx.post(fuzz_server.url + path, content=content, headers=headers, timeout=REQUEST_TIMEOUT_S)
        except httpx.HTTPError as e:
            fuzz_server.no_answer(shown, e)
        fuzz_server.check(shown, r.status_code, r.headers.get("content-type", ""), r.content)

    fuzz()


# --- every field at each of its edges, one at a time ------------------------------------------------------------

EDGE_STRINGS = ["", " ", "<|im_end|>", "<|endoftext|>", "\x00", "\ud800", "\udfff\ud800", "\U0001f600", "\u2028",
                "a" * 600]
WRONG_TYPES = [None, {}]
FLOAT_FIELDS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                "timeout"]
INT_FIELDS = ["max_tokens", "top_k", "n", "seed", "priority", "best_of"]
ID_LISTS = [[-1], [VOCAB], [2**31], [2**63], [10**30], [0] * 300, [0] * (MAX_MODEL_LEN + 1)]
BASES = {  # a valid request for each route, cheap to answer
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    "/v1/completions": {"prompt": "hi", "max_tokens": 1},
    "/v1/embeddings": {"input": "hi"},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [10, 20]},
}


def _edges(path: str) -> list[dict]:
    """Overrides of the route's valid request: each field at each edge of its type, and at the wrong types."""
    floats_, ints_ = EDGE_FLOATS, BIG_INTS + [MAX_MODEL_LEN]
    fields: dict[str, list] = {}
    if path in ("/v1/chat/completions", "/v1/completions"):
        fields |= {f: floats_ for f in FLOAT_FIELDS} | {f: ints_ for f in INT_FIELDS}
        fields |= {"model": EDGE_STRINGS, "user": EDGE_STRINGS,
                   "stop": EDGE_STRINGS + [[""], ["a"] * 20, ["\ud800"], ["a" * 600]]}
        fields["stop_token_ids"] = ID_LISTS
        fields["logprobs"] = ints_ if path == "/v1/completions" else [True, False]
    if path == "/v1/chat/completions":
        fields["max_completion_tokens"] = ints_
        fields["top_logprobs"] = ints_  # with logprobs: true (below)
        fields["messages"] = [[{"role": "user", "content": text}] for text in EDGE_STRINGS] + [
            [{"role": "user", "content": [{"type": "text", "text": text}]}] for text in EDGE_STRINGS + [None, 5, []]]
    if path == "/v1/completions":
        fields["prompt"] = (EDGE_STRINGS + ID_LISTS + [[ids] for ids in ID_LISTS]
                            + [["hi", text] for text in EDGE_STRINGS])
        fields["suffix"] = EDGE_STRINGS
    if path == "/v1/embeddings":
        fields = {"input": EDGE_STRINGS + ID_LISTS + [[ids] for ids in ID_LISTS], "dimensions": ints_,
                  "timeout": floats_, "model": EDGE_STRINGS, "user": EDGE_STRINGS}
    if path == "/tokenize":
        fields = {"prompt": EDGE_STRINGS, "model": EDGE_STRINGS,
                  "messages": [[{"role": "user", "content": text}] for text in EDGE_STRINGS]}
    if path == "/detokenize":
        fields = {"tokens": ID_LISTS, "model": EDGE_STRINGS}
    return [{field: value} | ({"logprobs": True} if field == "top_logprobs" else {})
            for field, values in fields.items() for value in [*values, *WRONG_TYPES]]


@pytest.mark.parametrize("path", list(BASES))
def test_each_field_at_each_of_its_edges(fuzz_server, path):
    """A sweep, not a search: every field of a valid request set to each edge value of its type (NaN, the
    infinities, 5e-324 and other floats below float32's range, integers past 64 bits, lone surrogates, special
    tokens, ids outside the vocabulary, the wrong JSON types), one field at a time; every other request streamed
    where the route streams. Every distinct failure is listed, not only the first."""
    streaming = path in ("/v1/chat/completions", "/v1/completions")
    headers = {**AUTH, "Content-Type": "application/json"}
    failures: dict[str, str] = {}
    for i, edge in enumerate(_edges(path)):
        body = BASES[path] | edge | ({"stream": True} if streaming and i % 2 else {})
        content = json.dumps(body).encode()
        shown = _shown("POST", path, content)
        try:
            fuzz_server.before()
            try:
                r = httpx.post(fuzz_server.url + path, content=content, headers=headers, timeout=REQUEST_TIMEOUT_S)
            except httpx.HTTPError as e:
                fuzz_server.no_answer(shown, e)
            fuzz_server.check(shown, r.status_code, r.headers.get("content-type", ""), r.content)
        except AssertionError as e:
            failures.setdefault(getattr(type(e), "cause", str(e)), str(e))  # the first request of each cause
    assert not failures, f"{len(failures)} distinct failures:\n\n" + "\n\n".join(failures.values())


# --- afterwards -----------------------------------------------------------------------------------------------


def test_still_serves_after_the_fuzzing(fuzz_server):
    """After all of the above: /health is 200, and a plain completion and chat completion succeed."""
    assert fuzz_server.hung_by is None, f"the server stopped answering after {fuzz_server.hung_by}"
    assert httpx.get(fuzz_server.url + "/health", timeout=30).status_code == 200
    r = httpx.post(fuzz_server.url + "/v1/completions", headers=AUTH, timeout=60,
                   json={"model": NAME, "prompt": "the cat", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("length", "stop") and r.json()["usage"]["completion_tokens"] >= 1
    r = httpx.post(fuzz_server.url + "/v1/chat/completions", headers=AUTH, timeout=60,
                   json={"model": NAME, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"
