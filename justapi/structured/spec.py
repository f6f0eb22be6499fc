"""What a request asks its output to be: a JSON schema, any JSON object, a regex, one of a list of strings, or a
grammar (EBNF/GBNF). Pure data, checked for size and shape here; compiled by structured.grammars.

The request fields follow OpenAI (``response_format``) and vLLM (``structured_outputs``: ``json``, ``regex``,
``choice``, ``grammar``, ``json_object``), so that either's clients work unchanged.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_SOURCE_BYTES = 64 * 1024  # a schema, regex or grammar longer than this is refused before compiling
MAX_CHOICES = 1024


@dataclass(frozen=True)
class StructuredOutput:
    """``kind`` and its ``source``: a JSON schema as canonical JSON text, a regex, a grammar, or for ``choice`` the
    strings as a JSON list. Equal specs compile to the same grammar (the compile cache's key)."""

    kind: str
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if len(self.source.encode()) > MAX_SOURCE_BYTES:
            raise ValueError(f"the {self.kind} constraint is {len(self.source.encode())} bytes; the limit is "
                             f"{MAX_SOURCE_BYTES}")

    @classmethod
    def json_schema(cls, schema) -> StructuredOutput:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
        return cls("json", json.dumps(schema, sort_keys=True, separators=(",", ":")))

    @classmethod
    def choice(cls, options) -> StructuredOutput:
        if not isinstance(options, list) or not options or not all(isinstance(o, str) and o for o in options):
            raise ValueError("choice must be a non-empty list of non-empty strings")
        if len(options) > MAX_CHOICES:
            raise ValueError(f"choice has {len(options)} options; the limit is {MAX_CHOICES}")
        return cls("choice", json.dumps(options))

    @property
    def options(self) -> list[str]:
        """The strings of a ``choice``."""
        return json.loads(self.source)


def from_structured_outputs(fields: dict) -> StructuredOutput:
    """vLLM's ``structured_outputs`` object: exactly one of json, regex, choice, grammar, json_object."""
    if not isinstance(fields, dict):
        raise ValueError("structured_outputs must be an object")
    unknown = set(fields) - {"json", "regex", "choice", "grammar", "json_object", "whitespace_pattern"}
    if unknown:
        raise ValueError(f"structured_outputs: unknown field(s) {', '.join(sorted(unknown))}")
    if fields.get("whitespace_pattern") is not None:
        raise ValueError("structured_outputs.whitespace_pattern is not supported")
    given = [k for k in ("json", "regex", "choice", "grammar") if fields.get(k) is not None]
    if fields.get("json_object"):
        given.append("json_object")
    if len(given) != 1:
        raise ValueError("structured_outputs must set exactly one of json, regex, choice, grammar, json_object"
                         + (f" (got {', '.join(given)})" if given else ""))
    kind = given[0]
    if kind == "json":
        return StructuredOutput.json_schema(fields["json"])
    if kind == "choice":
        return StructuredOutput.choice(fields["choice"])
    if kind == "json_object":
        return StructuredOutput("json_object")
    value = fields[kind]
    if not isinstance(value, str) or not value:
        raise ValueError(f"structured_outputs.{kind} must be a non-empty string")
    return StructuredOutput(kind, value)


def from_response_format(fmt: dict) -> StructuredOutput | None:
    """OpenAI's ``response_format``: text (no constraint), json_object, or json_schema {name, schema, strict}."""
    if not isinstance(fmt, dict):
        raise ValueError("response_format must be an object")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError("response_format.json_schema must be an object with name and schema")
        if "schema" not in spec:
            raise ValueError("response_format.json_schema.schema is missing")
        return StructuredOutput.json_schema(spec["schema"])
    raise ValueError(f"response_format.type must be text, json_object or json_schema, got {kind!r}")
