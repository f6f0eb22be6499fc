"""What one engine step costs, as a function of its shape: fitted to measured steps, stored per model and machine.

A step's shape is read from its cells, the (request, kind, first position, tokens) entries the scheduler records
for every step (core.step_record) and a server's step log returns (``/engine/steps``): the same function reads a
real run and a simulated one. Its time is modelled as

    base + products(rows) + per_context * decode context + per_pair * prompt attention pairs + per_seq * sequences
         + per_shared_context * reads of prompt blocks that decoding rows share

``products`` is piecewise linear in the rows the step sends through the weights (all its tokens): one row reads
every weight (memory-bound), more rows share that read until the products become compute-bound, and the kernel
route changes with the row count (docs/quantization.md), so its slope changes at a few knots. Decode attention
reads each decoding sequence's context; a prompt chunk's attention grows with the pairs of positions it relates.
The coefficients are fitted by least squares on relative error (short decode steps count as much as long prefill
steps), and the fit's error is measured on steps held out of it.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

KNOTS = (4, 16, 64, 256, 1024)  # rows where the products' slope may change (routes switch near 4-5 rows)
FORMAT = "justapi-plan-cost-model/2"
FOLDS = 5  # cross-validation folds for the reported error
MIN_STEPS = 40  # fewer measured steps than this cannot pin down the coefficients


class CostModelError(ValueError):
    """A cost model that cannot be fitted or read; the message says why."""


@dataclass(frozen=True)
class StepShape:
    """What a step computed: tokens through the products, decoding rows and the context they read, prompt tokens
    and the attention pairs their chunks relate, sequences in the batch."""

    rows: int
    decodes: int
    decode_context: int  # context tokens the decoding rows read, a block several of them share counted once
    prefill_tokens: int
    prefill_pairs: int
    seqs: int
    shared_context: int = 0  # the other reads of those shared blocks (from cache rather than memory)

    @classmethod
    def of_cells(cls, cells, blocks: Mapping[str, Sequence[Hashable]] | None = None, block_size: int = 16,
                 hits: Mapping[str, int] | None = None) -> StepShape:
        """From a step's cells: (request id, "prefill" | "decode" | "spec", first position, tokens, accepted).
        With ``blocks`` (request id -> its blocks), a block that several decoding rows hold counts once in their
        context and its other reads apart (``shared_context``): the step reads it from memory once, then from cache
        (measured: 32 rows sharing a 400-token prefix took 28-31 ms a step where 32 rows of 375 distinct tokens took
        36). The blocks are physical block ids (the simulation's), or without them the prompts' block hashes
        (core.router.block_chain) with ``hits``, each request's prefix-cache hit in tokens: a block below a
        request's hit is the cache's copy, shared; above it the request computed its own, which later requests may
        hit."""
        rows = decodes = context = prefill = pairs = shared = 0
        cached: set = set()  # blocks read so far in the step that others may share
        own: set = set()  # blocks a request computed itself (prompt keys only): shared with later hits, not alike
        for cell in cells:
            rid, kind, start, n = cell[0], cell[1], int(cell[2]), int(cell[3])
            rows += n
            if kind == "prefill":
                prefill += n
                pairs += n * start + n * (n + 1) // 2
                continue
            decodes += 1
            keys = blocks.get(rid, ()) if blocks is not None else ()
            full = min(len(keys), (start + n) // block_size)
            hit = full if hits is None else min(full, hits.get(rid, 0) // block_size)
            again = 0
            for b, key in enumerate(keys[:full]):
                if b < hit:  # the cache's copy (or, for physical ids, any block)
                    again += key in cached or key in own
                    cached.add(key)
                else:
                    again += key in cached
                    own.add(key)
            context += (start + n) - again * block_size
            shared += again * block_size
        return cls(rows, decodes, context, prefill, pairs, len(cells), shared)

    def features(self) -> list[float]:
        r = float(self.rows)
        return [1.0, r, *(max(0.0, r - k) for k in KNOTS), float(self.decode_context), float(self.prefill_pairs),
                float(self.seqs), float(self.shared_context)]


FEATURES = ("base", "per_row", *(f"per_row_above_{k}" for k in KNOTS), "per_context", "per_pair", "per_seq",
            "per_shared_context")
MIN_STEP_S = 1e-5  # a prediction is never below this (a fit's negative corner is noise, not a free step)


@dataclass(frozen=True)
class FitError:
    """The fit's error on steps it did not see (k-fold): median and p90 of |predicted / measured - 1| per step, and
    the error of the steps' total time."""

    steps: int
    median_rel: float
    p90_rel: float
    total_rel: float


@dataclass(frozen=True)
class CostModel:
    """Seconds of a step from its shape (``seconds``), with where it was measured and how well it fits."""

    coefficients: tuple[float, ...]
    model: str  # the model file's name
    machine: str  # the CPU (or hardware description) it was measured on
    threads: int
    error: FitError | None = None
    settings: dict | None = None  # the serving settings of the profiled server (chunk size, pool, ...)

    def seconds(self, shape: StepShape) -> float:
        return max(MIN_STEP_S, float(np.dot(self.coefficients, shape.features())))

    @property
    def front_s(self) -> float:
        """The profiled server's HTTP front: seconds before a request reached its engine."""
        return float((self.settings or {}).get("front_s", 0.0))

    @property
    def tail_s(self) -> float:
        """Seconds from a step's end until the client had its tokens."""
        return float((self.settings or {}).get("tail_s", 0.0))

    def describe(self) -> str:
        terms = ", ".join(f"{name} {c * 1e3:.4g} ms" for name, c in zip(FEATURES, self.coefficients) if c)
        err = self.error
        fit = (f"; held-out error: median {err.median_rel:.1%}, p90 {err.p90_rel:.1%} a step, total "
               f"{err.total_rel:+.1%} over {err.steps} steps") if err else ""
        return f"{self.model} on {self.machine} ({self.threads} threads): {terms}{fit}"

    def save(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        body = {"format": FORMAT, "features": FEATURES, "knots": KNOTS, **asdict(self)}
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(body, f, indent=1)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str) -> CostModel:
        try:
            with open(path) as f:
                body = json.load(f)
        except OSError as e:
            raise CostModelError(f"{path}: cannot read ({e.strerror})") from None
        except json.JSONDecodeError as e:
            raise CostModelError(f"{path}: not JSON ({e.msg})") from None
        if not isinstance(body, dict) or body.get("format") != FORMAT or list(body.get("knots", ())) != list(KNOTS):
            raise CostModelError(f"{path}: not a cost model of this version ({FORMAT}); run justapi plan profile")
        coefficients = body.get("coefficients")
        if not isinstance(coefficients, list) or len(coefficients) != len(FEATURES) or not all(
                isinstance(c, (int, float)) and math.isfinite(c) for c in coefficients):
            raise CostModelError(f"{path}: its coefficients are not {len(FEATURES)} finite numbers")
        error = FitError(**body["error"]) if body.get("error") else None
        return cls(tuple(float(c) for c in coefficients), str(body.get("model", "")), str(body.get("machine", "")),
                   int(body.get("threads", 0)), error, body.get("settings"))


PHYSICAL = tuple(FEATURES.index(f) for f in ("base", "per_context", "per_pair", "per_seq", "per_shared_context"))


def solve(shapes: list[StepShape], seconds: list[float]) -> tuple[float, ...]:
    """Least squares on relative error (each step's row divided by its time), the terms that are a cost in
    themselves (base, context, pairs, sequences, shared reads) kept at zero or above (a negative one is dropped and
    the rest refitted: a saving per sequence would turn into time gained past the profiled batch sizes), then
    scaled so that the steps' total is matched (relative error alone fits the total low)."""
    x = np.array([s.features() for s in shapes])
    y = np.array(seconds)
    w = 1.0 / np.maximum(y, MIN_STEP_S)
    active = list(range(len(FEATURES)))
    while True:
        part, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        coef = np.zeros(len(FEATURES))
        coef[active] = part
        negative = [i for i in PHYSICAL if i in active and coef[i] < 0]
        if not negative:
            break
        active.remove(min(negative, key=lambda i: coef[i]))
    predicted = np.maximum(x @ coef, MIN_STEP_S)
    return tuple(float(c) for c in coef * (y.sum() / predicted.sum()))


def held_out_error(shapes: list[StepShape], seconds: list[float], folds: int = FOLDS) -> FitError:
    """Each step predicted by a fit on the other folds, each fold a contiguous run of steps (neighbouring steps are
    alike: interleaved folds would leak them into the fit)."""
    predicted = np.zeros(len(shapes))
    bounds = np.linspace(0, len(shapes), folds + 1).astype(int)
    for lo, hi in zip(bounds, bounds[1:]):
        train = [i for i in range(len(shapes)) if not lo <= i < hi]
        coef = solve([shapes[i] for i in train], [seconds[i] for i in train])
        for i in range(lo, hi):
            predicted[i] = max(MIN_STEP_S, float(np.dot(coef, shapes[i].features())))
    y = np.array(seconds)
    rel = np.abs(predicted / y - 1)
    return FitError(len(shapes), float(np.median(rel)), float(np.percentile(rel, 90)),
                    float(predicted.sum() / y.sum() - 1))


def fit(shapes: list[StepShape], seconds: list[float], model: str, machine: str, threads: int,
        settings: dict | None = None) -> CostModel:
    """The cost model of these measured steps, with its held-out error and the largest step it saw (rows and
    sequences: past them it extrapolates)."""
    if len(shapes) != len(seconds):
        raise CostModelError("one time per step shape")
    if len(shapes) < MIN_STEPS:
        raise CostModelError(f"{len(shapes)} measured steps are too few to fit a cost model (at least {MIN_STEPS})")
    if any(not t > 0 for t in seconds):
        raise CostModelError("every measured step takes a positive time")
    seen = dict(seen_rows=max(s.rows for s in shapes), seen_seqs=max(s.seqs for s in shapes))
    return CostModel(solve(shapes, seconds), model, machine, threads, held_out_error(shapes, seconds),
                     settings={**(settings or {}), **seen})


ISA_NAMES = (("amx_tile", "AMX"), ("avx512_bf16", "AVX-512 BF16"), ("avx512f", "AVX-512"), ("avx2", "AVX2"))


def this_machine() -> str:
    """The CPU as /proc/cpuinfo names it, with its model number and widest instruction set (a virtual machine's
    name is often only "Intel Xeon Processor"), e.g. "Intel(R) Xeon(R) Processor, model 167, AMX"."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
                if not line.strip():
                    break
    except OSError:
        return platform.processor() or platform.machine()
    flags = set(info.get("flags", "").split())
    isa = next((name for flag, name in ISA_NAMES if flag in flags), "")
    parts = [info.get("model name", platform.machine()), f"model {info['model']}" if "model" in info else "", isa]
    return ", ".join(p for p in parts if p)


def default_path(model_path: str, machine: str) -> str:
    """Where ``justapi plan profile`` keeps the cost model of ``model_path`` on ``machine`` by default."""
    from ..config import cache_dir

    stem = os.path.splitext(os.path.basename(model_path))[0]
    slug = re.sub(r"[^a-z0-9]+", "-", machine.lower()).strip("-")
    return os.path.join(cache_dir(), "plan", f"{stem}--{slug}.json")


def load_costs(path: str | None, model: str) -> CostModel:
    """The cost model at ``path``, or ``justapi plan profile``'s default one for ``model`` on this CPU."""
    path = path or default_path(model, this_machine())
    try:
        return CostModel.load(path)
    except CostModelError as e:
        raise CostModelError(f"{e} (justapi plan profile -- --model {model} fits one)") from None
