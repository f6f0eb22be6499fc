"""The command line, generated from the config's fields (config.flag): one source for each flag's name, type,
default and help, which builds the argparse flags, turns parsed arguments back into configs, and writes the
README's flags table (a test fails when the README's copy is stale)."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing

from . import config as C
from .server_config import ServerConfig


def cli_fields(cls) -> list[dataclasses.Field]:
    """The fields of a config class that are flags (made with config.flag)."""
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def flag_name(f: dataclasses.Field) -> str:
    """``--max-seqs`` for ``max_seqs``; ``--no-prefix-cache`` for a bool that defaults to True."""
    if f.metadata["flag"]:
        return f.metadata["flag"]
    name = f.name.replace("_", "-")
    return f"--no-{name}" if f.default is True else f"--{name}"


def _value_type(f: dataclasses.Field, cls):
    """The Python type a flag's text converts to: int, float or str (``X | None`` counts as X)."""
    hint = typing.get_type_hints(cls)[f.name]
    if isinstance(hint, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def _comma_list(text: str) -> tuple[str, ...]:
    return tuple(item for item in text.split(",") if item)


def add_flags(parser: argparse.ArgumentParser, cls) -> None:
    """One flag per field of ``cls`` made with config.flag; the parsed value lands under the field's name."""
    for f in cli_fields(cls):
        kind, meta = _value_type(f, cls), f.metadata
        if kind is bool:
            action = "store_false" if f.default is True else "store_true"
            parser.add_argument(flag_name(f), dest=f.name, action=action, help=flag_help(f))
            continue
        convert = _comma_list if typing.get_origin(kind) is tuple else kind
        metavar = meta["metavar"] or (None if meta["choices"] else flag_name(f)[2:].upper().replace("-", "_"))
        repeat = {"action": "append"} if meta.get("repeat") else {}
        parser.add_argument(flag_name(f), dest=f.name, type=convert, default=f.default, choices=meta["choices"],
                            metavar=metavar, help=meta["help"] + _default_note(f), **repeat)


def flag_help(f: dataclasses.Field) -> str:
    """The field's help, as its flag does it: ``--no-...`` turns the described feature off."""
    return ("turn off " if f.default is True else "") + f.metadata["help"]


def _default_note(f: dataclasses.Field) -> str:
    """`` (default: %(default)s)`` where the help does not say it: argparse fills it in, and its
    ArgumentDefaultsHelpFormatter (used by some subcommands) then adds none of its own."""
    if f.default is None or f.default == () or "(default:" in f.metadata["help"]:
        return ""
    return " (default: %(default)s)"


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """The engine's flags, and ``--scheduled``, kept from when the static baseline was the default."""
    add_flags(parser, C.EngineConfig)
    parser.add_argument("--scheduled", action="store_true", help=argparse.SUPPRESS)


def config_from_args(cls, args: argparse.Namespace, **overrides):
    """An instance of ``cls`` from the parsed flags (ValueError from its checks propagates)."""
    values = {f.name: getattr(args, f.name) for f in cli_fields(cls) if hasattr(args, f.name)}
    return cls(**{**values, **overrides})


def flags_argv(args: argparse.Namespace, skip: set[str]) -> list[str]:
    """The engine and server flags ``args`` sets to something other than their defaults, as command-line words
    (a several-model server gives them to each model's process), less the fields named in ``skip``."""
    words: list[str] = []
    for cls in (C.EngineConfig, ServerConfig):
        for f in cli_fields(cls):
            value = getattr(args, f.name, f.default)
            if f.name in skip or value == f.default:
                continue
            if isinstance(value, bool):
                words.append(flag_name(f))
            elif isinstance(value, tuple):
                words += [flag_name(f), ",".join(value)]
            else:
                words += [flag_name(f), str(value)]
    return words


def flags_table() -> str:
    """The README's flags table: every flag of ``justapi serve``, its default and what it does."""
    rows = ["| flag | default | what it does |", "|---|---|---|"]
    for cls in (C.EngineConfig, ServerConfig):
        for f in cli_fields(cls):
            kind = _value_type(f, cls)
            default = "" if kind is bool or f.default in (None, ()) else f"`{f.default}`"
            choices = f" ({', '.join(f.metadata['choices'])})" if f.metadata["choices"] else ""
            rows.append(f"| `{flag_name(f)}` | {default} | {flag_help(f).replace('|', '/')}{choices} |")
    return "\n".join(rows)
