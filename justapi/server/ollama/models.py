"""What Ollama's listing routes say of the served model (/api/tags, /api/ps, /api/show), read from its GGUF file."""

from __future__ import annotations

import functools
import hashlib
import os
from datetime import datetime, timezone

from ...model.gguf_loader import field_value, open_gguf


@functools.lru_cache(maxsize=4)
def _file_facts(path: str, mtime_ns: int, size: int) -> dict:
    """The file's architecture, parameter count, quantization, and a digest (SHA-256 of its first MiB and its size:
    the whole file's would read gigabytes for a listing)."""
    import gguf

    reader = open_gguf(path)
    params = sum(int(t.n_elements) for t in reader.tensors)
    file_type = field_value(reader, "general.file_type")
    try:
        quant = gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_") if file_type is not None else "unknown"
    except ValueError:
        quant = str(file_type)
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read(1 << 20) + str(size).encode()).hexdigest()
    return {"parameters": params, "quantization": quant, "digest": digest,
            "arch": str(field_value(reader, "general.architecture"))}


def _facts(path: str) -> dict:
    st = os.stat(path)
    return _file_facts(os.path.abspath(path), st.st_mtime_ns, st.st_size) | {"size": st.st_size,
                                                                              "mtime": st.st_mtime}


def _parameter_size(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}".rstrip("0").rstrip(".") + unit
    return str(n)


def details(path: str) -> dict:
    facts = _facts(path)
    arch = facts["arch"]
    return {"parent_model": "", "format": "gguf", "family": arch, "families": [arch],
            "parameter_size": _parameter_size(facts["parameters"]), "quantization_level": facts["quantization"]}


def model_entry(path: str, name: str) -> dict:
    """/api/tags' entry for a model served as ``name`` from the GGUF file ``path``."""
    facts = _facts(path)
    modified = datetime.fromtimestamp(facts["mtime"], timezone.utc).isoformat().replace("+00:00", "Z")
    return {"name": f"{name}:latest", "model": f"{name}:latest", "modified_at": modified, "size": facts["size"],
            "digest": facts["digest"], "details": details(path)}


def capabilities(engine) -> list[str]:
    cfg = engine.model_config
    if cfg.is_encoder or cfg.pooling == "rank":
        return ["embedding"]
    caps = (["completion"] + (["tools"] if engine.tool_parser else [])
            + (["thinking"] if engine.reasoning_parser else []))
    return caps + (["embedding"] if cfg.pooling != "last" else [])


def show(engine, name: str) -> dict:
    """/api/show: the model's details, its GGUF facts as Ollama's model_info keys, its template, capabilities."""
    cfg = engine.model_config
    path = engine.config.model
    info = {"general.architecture": cfg.arch, "general.parameter_count": _facts(path)["parameters"],
            f"{cfg.arch}.context_length": cfg.context_length, f"{cfg.arch}.embedding_length": cfg.hidden_size,
            f"{cfg.arch}.block_count": cfg.num_layers, f"{cfg.arch}.attention.head_count": cfg.num_heads,
            f"{cfg.arch}.attention.head_count_kv": cfg.num_kv_heads}
    return {"modelfile": f"# served by JustAPI\nFROM {engine.config.model}\n", "parameters": "",
            "template": engine.chat_template.source or "", "details": details(path), "model_info": info,
            "capabilities": capabilities(engine), "modified_at": model_entry(path, name)["modified_at"]}
