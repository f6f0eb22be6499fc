"""What a hybrid model's GGUF file states about its recurrent layers, as llama.cpp's converter writes it: which
layers are recurrent and the recurrent layers' sizes (model_config.RecurrentShape).

- lfm2: ``{arch}.attention.head_count_kv`` is an array, 0 for a short-convolution layer; ``{arch}.shortconv.l_cache``
  is the convolution's length.
- qwen35, qwen35moe: every ``{arch}.full_attention_interval``-th layer attends (3, 7, ... for 4), the others are
  Gated DeltaNet with ``{arch}.ssm.{conv_kernel, group_count, time_step_rank, state_size, inner_size}``.
"""

from __future__ import annotations

from ..model_config import RecurrentShape
from .gguf_reader import ModelLoadError, field_value


def kv_heads(reader, arch: str, num_heads: int) -> int:
    """The attention layers' KV heads: the key's value, or an array's largest entry (LFM2's 0s mark its recurrent
    layers)."""
    value = field_value(reader, f"{arch}.attention.head_count_kv", num_heads)
    return int(max(value) if isinstance(value, list) else value)


def recurrent_layers(reader, arch: str, num_layers: int, path: str) -> tuple[tuple[bool, ...], RecurrentShape | None]:
    """Per layer whether it is recurrent, and the recurrent layers' shape; ((), None) for a model without any."""
    if arch == "lfm2":
        heads = field_value(reader, f"{arch}.attention.head_count_kv")
        if not isinstance(heads, list) or len(heads) != num_layers:
            raise ModelLoadError(f"{path}: {arch}.attention.head_count_kv must list each of the {num_layers} layers' "
                                 "KV heads (0 for a convolution layer)")
        shape = RecurrentShape("short_conv", _need(reader, arch, "shortconv.l_cache", path))
        return tuple(h == 0 for h in heads), shape
    if arch in ("qwen35", "qwen35moe"):
        interval = int(field_value(reader, f"{arch}.full_attention_interval", 4))
        if interval < 1:
            raise ModelLoadError(f"{path}: {arch}.full_attention_interval is {interval}, not a positive number")
        value_heads = _need(reader, arch, "ssm.time_step_rank", path)
        shape = RecurrentShape(
            "gated_delta", _need(reader, arch, "ssm.conv_kernel", path),
            key_heads=_need(reader, arch, "ssm.group_count", path), value_heads=value_heads,
            key_dim=_need(reader, arch, "ssm.state_size", path),
            value_dim=_need(reader, arch, "ssm.inner_size", path) // value_heads)
        if shape.value_heads % shape.key_heads:
            raise ModelLoadError(f"{path}: {arch}'s {shape.value_heads} value heads are not a multiple of its "
                                 f"{shape.key_heads} key heads")
        return tuple((i + 1) % interval != 0 for i in range(num_layers)), shape
    return (), None


def _need(reader, arch: str, key: str, path: str) -> int:
    value = field_value(reader, f"{arch}.{key}")
    if value is None or int(value) < 1:
        raise ModelLoadError(f"{path}: metadata key {arch}.{key} is {'missing' if value is None else value}")
    return int(value)
