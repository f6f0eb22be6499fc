"""What a grammar compile worker runs (structured.compile_workers): a client's constraint compiled by xgrammar, JSON
schemas kept compact and their strings valid JSON, a choice as its grammar; GrammarError naming what failed."""

from __future__ import annotations

import json

from .spec import StructuredOutput


class GrammarError(ValueError):
    """A schema, regex or grammar that cannot be compiled (or not within the limits): the client's error."""


_LAX_STRING_CHAR = '[^\\"\\\\\\r\\n]'  # as xgrammar prints it: [^\"\\\r\n]
_JSON_STRING_CHAR = '[^\\0-\\x1f\\"\\\\]'  # no quote, no backslash, no control character
_NAMES = {"json": "JSON schema", "json_object": "JSON", "regex": "regex", "choice": "choice",
          "grammar": "grammar"}


def compile_spec(xgr, compiler, spec: StructuredOutput):
    """``spec`` compiled by ``compiler`` (run in a compile worker); GrammarError with the parser's first line."""
    try:
        if spec.kind == "json":
            return compiler.compile_grammar(_schema_grammar(xgr, spec.source))
        if spec.kind == "json_object":  # OpenAI's JSON mode: an object (llama.cpp's reading too), compact
            return compiler.compile_grammar(_schema_grammar(xgr, JSON_OBJECT_SCHEMA))
        if spec.kind == "regex":
            return compiler.compile_regex(spec.source)
        if spec.kind == "choice":
            return compiler.compile_grammar(choice_grammar(spec.options))
        return compiler.compile_grammar(spec.source)
    except Exception as e:  # xgrammar raises RuntimeError / ValueError with its parser's message
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise GrammarError(f"invalid {_NAMES[spec.kind]}: {message}") from None


JSON_OBJECT_SCHEMA = '{"type": "object"}'


def _schema_grammar(xgr, schema: str):
    """xgrammar's grammar of a JSON schema, with its strings kept valid JSON: a string with minLength or maxLength
    becomes repetitions of ``[^"\\\r\n]`` there (xgrammar 0.2.8), which lets raw control characters through (JSON
    forbids U+0000-U+001F unescaped; Python's and pydantic's parsers reject them). Compact, as OpenAI's models
    write it (``{"a": 1, "b": [2, 3]}``): no whitespace but one space after each comma and colon, so a small model
    cannot spend its budget on indentation."""
    text = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))
    return xgr.Grammar.from_ebnf(text.replace(_LAX_STRING_CHAR, _JSON_STRING_CHAR))


def choice_grammar(options: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly ``options`` (JSON string literals escape every character)."""
    return "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)
