"""The models a several-model server may load (engine.models): ``--model`` repeated (``PATH`` or ``NAME=PATH``)
and every GGUF in ``--models-dir``, each named by its file, with aliases and flags of its own from the folder's
``models.toml``::

    [aliases]            # other names clients may use
    chat = "SmolLM2-135M-Instruct-Q4_1"

    [flags]              # justapi serve flags for one model's process
    "SmolLM2-135M-Instruct-Q4_1" = ["--spec-method", "ngram"]

A mistake in either is a ValueError naming it, before anything loads.
"""

from __future__ import annotations

import os
import tomllib

from .models import ModelSpec

CATALOG_FILE = "models.toml"
# set by the server for each model's process: a models.toml may not give them
SERVER_SET_FLAGS = ("--model", "--served-model-name", "--host", "--port", "--kv-memory", "--models-dir")


def model_specs(models: list[str], models_dir: str | None) -> list[ModelSpec]:
    """The specs of the ``--model`` entries, then of ``models_dir``'s files (sorted by name)."""
    specs = [_entry(m) for m in models]
    if models_dir is not None:
        specs += _folder(models_dir)
    seen: set[str] = set()
    for name in (n for s in specs for n in (s.name, *s.aliases)):
        if name in seen:
            raise ValueError(f"two models are named {name!r}: give one of them NAME=PATH")
        seen.add(name)
    if not specs:
        raise ValueError(f"--models-dir {models_dir}: no .gguf file in it")
    return specs


def _entry(text: str) -> ModelSpec:
    """``NAME=PATH`` or ``PATH`` (named by its file)."""
    name, eq, path = text.partition("=")
    if not eq or os.sep in name:
        name, path = _stem(text), text
    if not os.path.isfile(path):
        raise ValueError(f"--model {text}: no such file")
    return ModelSpec(name, path)


def _stem(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0]


def _folder(folder: str) -> list[ModelSpec]:
    if not os.path.isdir(folder):
        raise ValueError(f"--models-dir {folder}: no such folder")
    paths = {_stem(f): os.path.join(folder, f) for f in sorted(os.listdir(folder)) if f.endswith(".gguf")}
    aliases, flags = _catalog(os.path.join(folder, CATALOG_FILE), set(paths))
    return [ModelSpec(name, path, tuple(a for a, target in aliases.items() if target == name),
                      tuple(flags.get(name, ()))) for name, path in paths.items()]


def _catalog(path: str, names: set[str]) -> tuple[dict[str, str], dict[str, list[str]]]:
    """models.toml's aliases and flags, checked against the folder's model names."""
    if not os.path.exists(path):
        return {}, {}
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"{path}: {e}") from None
    unknown = set(data) - {"aliases", "flags"}
    if unknown:
        raise ValueError(f"{path}: unknown table {sorted(unknown)[0]!r} (it has [aliases] and [flags])")
    aliases, flags = data.get("aliases", {}), data.get("flags", {})
    if not isinstance(aliases, dict) or not isinstance(flags, dict):
        raise ValueError(f"{path}: [aliases] and [flags] must be tables")
    for alias, target in aliases.items():
        if not isinstance(target, str) or target not in names:
            raise ValueError(f"{path}: alias {alias!r} names {target!r}, which is not a .gguf file in the folder")
    for name, given in flags.items():
        if name not in names:
            raise ValueError(f"{path}: flags for {name!r}, which is not a .gguf file in the folder")
        if not isinstance(given, list) or not all(isinstance(g, str) for g in given):
            raise ValueError(f"{path}: the flags of {name!r} must be a list of strings")
        taken = [g for g in given if g.split("=")[0] in SERVER_SET_FLAGS]
        if taken:
            raise ValueError(f"{path}: {taken[0]} is set by the server for each model, not in models.toml")
    return aliases, flags
