"""Hardware from first principles: what a model's step reads and computes (``ModelShape``), what a machine reads and
computes a second (``Hardware``: named descriptions; this machine's read and matmul rates measured, for
benchmarks/bounds.py), and the roofline cost of a step shape from the two (``RooflineCosts``), for machines this
project cannot run on.

A step of R rows (tokens through the products) costs at least the roofline of its products plus that of its
attention (separate kernels, run one after the other), the step's fixed overhead and tensor parallelism's
all-reduces:

    max(weight bytes / bandwidth, products' FLOP / rate) + max(K/V bytes / bandwidth, attention FLOP / rate) + ...

weight bytes: every weight once (sharded over TP ranks); products' FLOP: 2 per weight for each row through the
layers, 2 per head weight for each sequence sampled; K/V bytes: every decoding row's context; attention FLOP:
4 * heads * head_dim for each (query, key) pair of each attention layer (QK^T and PV). Bandwidth and rate are each
the peak times an efficiency (what a tuned engine reaches of it: an assumption, stated beside each estimate). The
all-reduces: two a layer (after attention and after the MLP) of R x hidden bf16 values, each a latency plus
2 (tp - 1) / tp of its bytes over the link (a ring). Left out: sliding windows in a step's K/V reads (its decode
context is a sum over rows), MoE experts (a dense model's arithmetic), prefill attention's K/V reads (tiles keep
them on chip), and any per-sequence cost on the host (scheduling, sampling, detokenizing).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from .cost_model import StepShape

KV_BYTES = 2  # a bf16 KV cache


@dataclass(frozen=True)
class ModelShape:
    """What the arithmetic needs of a model: its sizes, the bytes of its weights as stored, its attention windows."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    weight_bytes: float  # every layer tensor and the head, as stored: what one step reads
    windows: tuple[int | None, ...] = ()  # per attention layer (None: the whole context); () all full
    recurrent_layers: int = 0  # a hybrid's layers without attention

    @classmethod
    def from_gguf(cls, path: str) -> ModelShape:
        import os

        from ..model.gguf_loader import open_gguf, read_model_config

        reader = open_gguf(path)
        cfg = read_model_config(reader, path)
        sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
        head = "output.weight" if "output.weight" in sizes else "token_embd.weight"
        # every layer tensor and the head are read for each step; the embedding only its rows (tied or not)
        weights = sum(n for name, n in sizes.items() if name.startswith("blk.")) + sizes[head]
        attention = [i for i in range(cfg.num_layers) if not cfg.is_recurrent(i)]
        return cls(os.path.basename(path), cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                   cfg.head_dim, cfg.intermediate_size, cfg.vocab_size, weights,
                   tuple(cfg.window(i) for i in attention), cfg.num_layers - len(attention))

    @classmethod
    def dense(cls, name: str, layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int, vocab: int,
              bytes_per_weight: float = 2.0) -> ModelShape:
        """A dense decoder stored at ``bytes_per_weight`` (bf16: 2, fp8: 1), untied head."""
        head_dim = hidden // heads
        shape = cls(name, layers, hidden, heads, kv_heads, head_dim, intermediate, vocab, 0.0)
        return cls(name, layers, hidden, heads, kv_heads, head_dim, intermediate, vocab,
                   (shape.layer_weights + shape.head_weights) * bytes_per_weight)

    @property
    def attention_layers(self) -> int:
        return self.layers - self.recurrent_layers

    @property
    def layer_weights(self) -> float:
        """Weights of every layer's products (Q, K, V, O and the gated MLP's three)."""
        h, d = self.hidden, self.head_dim
        return self.layers * (h * self.heads * d * 2 + h * self.kv_heads * d * 2 + 3 * h * self.intermediate)

    @property
    def head_weights(self) -> float:
        return self.vocab * self.hidden

    @property
    def attn_flop(self) -> float:
        """FLOP per attention layer and (query, key) pair: QK^T and PV."""
        return 4 * self.heads * self.head_dim

    def _windows(self) -> tuple[int | None, ...]:
        return self.windows or (None,) * self.attention_layers

    def kv_bytes(self, context: float) -> float:
        """K and V a decode token reads over ``context`` tokens, every attention layer (its window where it has
        one), in a bf16 cache."""
        row = 2 * self.kv_heads * self.head_dim * KV_BYTES
        return sum(row * min(context, w or context) for w in self._windows())

    def kv_bytes_per_token(self) -> float:
        """What one token's K/V takes in a bf16 cache, every attention layer."""
        return 2 * self.kv_heads * self.head_dim * KV_BYTES * self.attention_layers

    def attention(self, start: int, queries: int) -> float:
        """FLOP of the queries at positions start .. start + queries - 1: each sees its position + 1 keys (at most
        its layer's window)."""

        def seen(n: int, w: int | None) -> float:  # keys seen by the queries at positions 0 .. n - 1
            if w is None or n <= w:
                return n * (n + 1) / 2
            return w * (w + 1) / 2 + (n - w) * w

        return self.attn_flop * sum(seen(start + queries, w) - seen(start, w) for w in self._windows())


# Public architecture figures (each model's config.json), for machines where the file is not at hand.
MODELS = {
    "llama-3.1-8b": dict(layers=32, hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=128256),
    "llama-3.1-70b": dict(layers=80, hidden=8192, heads=64, kv_heads=8, intermediate=28672, vocab=128256),
    "qwen2.5-7b": dict(layers=28, hidden=3584, heads=28, kv_heads=4, intermediate=18944, vocab=152064),
}


def model_shape(name: str, bytes_per_weight: float = 2.0) -> ModelShape:
    """A GGUF file's shape, or a named one of MODELS (stored at ``bytes_per_weight``)."""
    if name.endswith(".gguf"):
        return ModelShape.from_gguf(name)
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}: give a GGUF file or one of {', '.join(MODELS)}")
    return ModelShape.dense(name, **MODELS[name], bytes_per_weight=bytes_per_weight)


@dataclass(frozen=True)
class Hardware:
    """One device as the roofline sees it (peaks, and the share of each a tuned engine reaches)."""

    name: str
    read_gbps: float  # memory read bandwidth, peak
    tflops: float  # dense matmul rate in the compute dtype (bf16), peak
    memory_gib: float  # per device
    link_gbps: float = 0.0  # device-to-device within a node, one direction (NVLink), per device
    link_latency_us: float = 0.0  # one all-reduce's fixed cost
    network_gbps: float = 0.0  # between nodes, per device (its NIC)
    network_latency_us: float = 0.0
    step_overhead_us: float = 0.0  # a step's fixed cost: launches, scheduling, sampling (an assumption)
    devices: int = 1  # per node: TP stays within one
    price_hour: float = 1.0  # per device, for "cheapest"; relative units unless stated
    bandwidth_efficiency: float = 1.0
    flop_efficiency: float = 1.0
    note: str = ""

    def describe(self) -> str:
        return (f"{self.name}: {self.read_gbps:.0f} GB/s x {self.bandwidth_efficiency:.0%}, {self.tflops:g} TFLOP/s x "
                f"{self.flop_efficiency:.0%}, {self.memory_gib:g} GiB, link {self.link_gbps:g} GB/s + "
                f"{self.link_latency_us:g} us, step overhead {self.step_overhead_us:g} us; {self.note}")


# Vendor peaks (dense bf16, no sparsity); efficiencies and overheads are assumptions, checked against an anchor
# (docs/plan.md).
HARDWARE = {
    "h200": Hardware("h200", 4800, 989, 141, link_gbps=450, link_latency_us=8, network_gbps=50, network_latency_us=10,
                     step_overhead_us=2000, devices=8,
                     bandwidth_efficiency=0.8, flop_efficiency=0.6,
                     note="H200 SXM peaks; 80% of HBM, 60% of dense bf16 reached; 2 ms a step outside the "
                          "products (scheduling, sampling, launches between CUDA graphs); 400 Gb/s a GPU between "
                          "nodes"),
    "h100": Hardware("h100", 3350, 989, 80, link_gbps=450, link_latency_us=8, network_gbps=50, network_latency_us=10,
                     step_overhead_us=2000, devices=8,
                     bandwidth_efficiency=0.8, flop_efficiency=0.6,
                     note="H100 SXM peaks, the same assumptions as h200"),
}


def best_seconds(f, reps: int = 5) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t)
    return best


def measure_read_gbps() -> float:
    """This machine's read bandwidth: a 1 GiB fp32 tensor summed on all threads, best of 5."""
    import torch

    t = torch.ones(1 << 28)
    return t.nbytes / best_seconds(t.sum) / 1e9


def measure_gflops(dtype_name: str) -> float:
    """torch's matmul rate in ``dtype_name`` ("bfloat16", "float32"): square sizes 1024-4096, best of 5 each."""
    import torch

    dtype = getattr(torch, dtype_name)
    rate = 0.0
    for n in (1024, 2048, 3072, 4096):
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        a @ b
        rate = max(rate, 2 * n ** 3 / best_seconds(lambda: a @ b) / 1e9)
    return rate


@dataclass(frozen=True)
class RooflineCosts:
    """A step's seconds on ``tp`` devices of ``hardware`` serving ``model``, from first principles."""

    model: ModelShape
    hardware: Hardware
    tp: int = 1

    def seconds(self, shape: StepShape) -> float:
        """The products' roofline plus attention's (separate kernels, one after the other), the step's overhead
        and the all-reduces."""
        m, hw, tp = self.model, self.hardware, self.tp
        bandwidth, rate = hw.read_gbps * 1e9 * hw.bandwidth_efficiency, hw.tflops * 1e12 * hw.flop_efficiency
        products = max(m.weight_bytes / tp / bandwidth,
                       (2 * m.layer_weights * shape.rows + 2 * m.head_weights * shape.seqs) / tp / rate)
        # windows aside: a decoding row's reads grow with its whole context
        context = shape.decode_context + shape.shared_context  # every row reads its whole context
        attention = max(m.kv_bytes_per_token() * context / tp / bandwidth,
                        m.attn_flop * m.attention_layers * (context + shape.prefill_pairs) / tp / rate)
        return products + attention + hw.step_overhead_us * 1e-6 + self.all_reduce_seconds(shape.rows)

    def all_reduce_seconds(self, rows: int) -> float:
        """Two ring all-reduces a layer of ``rows`` x hidden bf16 values."""
        if self.tp == 1:
            return 0.0
        hw = self.hardware
        nbytes = rows * self.model.hidden * 2
        one = hw.link_latency_us * 1e-6 + 2 * (self.tp - 1) / self.tp * nbytes / (hw.link_gbps * 1e9)
        return 2 * self.model.layers * one

    def transfer_seconds(self, tokens: int, across_nodes: bool = False) -> float:
        """A disaggregated request's prompt KV from a prefill worker to a decode worker: each of the ``tp`` ranks
        sends its heads' share over its own link within a node, or its own NIC between nodes."""
        hw = self.hardware
        latency, gbps = ((hw.network_latency_us, hw.network_gbps) if across_nodes else
                         (hw.link_latency_us, hw.link_gbps))
        return latency * 1e-6 + tokens * self.model.kv_bytes_per_token() / self.tp / (gbps * 1e9)

    def describe(self) -> str:
        return f"roofline of {self.model.name} on {self.tp} x {self.hardware.describe()}"

    def kv_pool_blocks(self, block_size: int, utilization: float = 0.9) -> int:
        """Blocks the devices' memory holds beside the weights (``utilization`` of it, vLLM's default share)."""
        free = self.hardware.memory_gib * 2**30 * utilization * self.tp - self.model.weight_bytes
        per_block = self.model.kv_bytes_per_token() * block_size
        if free < per_block:
            raise ValueError(f"{self.model.name} ({self.model.weight_bytes / 2**30:.1f} GiB) leaves no room for a "
                             f"KV cache on {self.tp} x {self.hardware.name}")
        return int(free // per_block)
