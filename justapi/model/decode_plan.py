"""A decode step's layers in one native call (kernels/decode_step.cpp ``DecodeLayers``), built once at load.

The Python loop over layers (model.blocks) dispatches a few dozen ops a layer from Python: on a decode step that
is 12% of SmolLM2's forward at 1-32 rows and 20% of Gemma 3's on a Xeon (docs/benchmarks.md). ``DecodeLayers``
calls the same kernels with the same tensors in the same order, each weight's route picked by the batch's rows
from the weight's own table, so its result is the loop's bit for bit (tests/test_decode_step.py). It serves a
step whose every row is one sequence's next token (no prompt chunk, no draft tree); the loop serves the rest.

``decode_layers(model)`` is None with ``--disable-kernels decode_step``, and where some part is not one the
native loop has (a hybrid's recurrent layers, experts, tensor parallelism, a layer without RoPE or with partial
rotary, a soft-cap, gated attention, a plain weight in oneDNN's prepacked layout, the pure-torch path,
--batch-invariant); the reason is logged once.
"""

from __future__ import annotations

import logging

import torch

from .blocks import Attention, DenseMlp
from .quant import _RoutedWeight  # noqa: PLC2701

log = logging.getLogger("justapi.model")


class NotNative(Exception):
    """A part the native loop does not have: the Python loop serves the model."""


def decode_layers(model):
    """The model's ``DecodeLayers`` with the RoPE tables its layers read, or None (module docstring)."""
    kernels = model.kernels
    try:
        if not model.policy.uses("decode_step") or not model.policy.layer_ops:
            raise NotNative("no C++ kernels, or --disable-kernels decode_step")
        if model.batch_invariant or model.tp is not None:
            raise NotNative("--batch-invariant or tensor parallelism")
        ropes: list = []
        native = kernels.DecodeLayers(model.config.rms_norm_eps, model.policy.uses("fused_silu"))
        for layer in model.layers:
            native.add(*_layer_args(layer, ropes))
        return native, ropes
    except NotNative as why:
        log.info("decode steps through the Python layer loop: %s", why)
        return None


def _layer_args(layer, ropes: list) -> tuple:
    """DecodeLayers.add's arguments for ``layer``; its RoPE table appended to ``ropes`` where it is new."""
    attn, mlp = layer.attn, layer.mlp
    if not isinstance(attn, Attention) or not isinstance(mlp, DenseMlp):
        raise NotNative(f"a {type(attn).__name__} / {type(mlp).__name__} layer")
    if attn.rope is None or not attn.rope.whole or attn.softcap is not None or attn.gated:
        raise NotNative("a layer without whole RoPE, or with a soft-cap or an output gate")
    if mlp.act not in ("silu", "gelu_tanh"):
        raise NotNative(f"activation {mlp.act}")
    if attn.rope not in ropes:
        ropes.append(attn.rope)
    return (layer.attn_norm, layer.ffn_norm, layer.post_attn_norm, layer.post_ffn_norm, layer.residual_scale,
            _weight(attn.qkv), attn.qkv_bias, attn.q_norm, attn.k_norm, _weight(attn.o), attn.heads, attn.kv_heads,
            attn.head_dim, attn.scale, attn.window or 0, ropes.index(attn.rope), attn.rope.style == "neox",
            _weight(mlp.gate_up), _weight(mlp.down), mlp.act == "gelu_tanh")


def _weight(w):
    """A plain tensor as it is; a routed weight as (computes in bf16, its outputs, its routes as quant's
    ``native_routes``)."""
    if isinstance(w, torch.Tensor):
        if w.is_mkldnn:
            raise NotNative("a plain weight in oneDNN's prepacked layout")
        return w
    routes = w.native_routes() if isinstance(w, _RoutedWeight) else None
    if routes is None:
        raise NotNative(f"a {type(w).__name__} weight with a route no native call has")
    return (w.dtype == torch.bfloat16, w.shape[0], routes)
