"""Byte sizes as the command line gives them (``--kv-memory 2G``, ``--models-memory 512M``)."""

from __future__ import annotations

_SIZE_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_size(text: str, flag_name: str) -> int:
    """Bytes from ``2G``, ``512M``, ``1.5G``, ``300000`` (binary units; an optional trailing B or iB); ValueError naming
    ``flag_name`` for anything else or for a size below 1 MiB."""
    raw = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = raw[-1:] if raw[-1:] in _SIZE_UNITS else ""
    try:
        value = float(raw[: len(raw) - len(unit)]) * _SIZE_UNITS[unit]
    except ValueError:
        raise ValueError(f"{flag_name} must be a size such as 2G or 512M, not {text!r}") from None
    if not value >= 2**20:
        raise ValueError(f"{flag_name} must be at least 1M, not {text!r}")
    return int(value)
