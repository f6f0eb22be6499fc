"""Figures of a benchmark run: throughput, latency percentiles, goodput, and each figure's ratio to a baseline."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .client import RequestResult

PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2e")  # reported in milliseconds


@dataclass
class Slo:
    """Goodput targets: a request counts as good when every given target is met (milliseconds)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    @classmethod
    def parse(cls, items: list[str] | None) -> Slo:
        """``["ttft:500", "tpot:100"]`` → Slo; a clear ValueError for anything else."""
        slo = cls()
        for item in items or ():
            key, _, value = item.partition(":")
            if key not in ("ttft", "tpot", "e2e"):
                raise ValueError(f"--goodput takes ttft:MS, tpot:MS or e2e:MS, not {item!r}")
            try:
                ms = float(value)
            except ValueError:
                raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
            if ms <= 0:
                raise ValueError(f"--goodput {item!r}: the target must be positive")
            setattr(slo, f"{key}_ms", ms)
        return slo

    def met(self, r: RequestResult) -> bool:
        if not r.ok:
            return False
        ttft = r.ttft if r.ttft is not None else r.e2e  # no text at all: the first token came at the end
        checks = ((self.ttft_ms, ttft), (self.tpot_ms, r.tpot if r.tpot is not None else 0.0), (self.e2e_ms, r.e2e))
        return all(target is None or value * 1000 <= target for target, value in checks)

    @property
    def given(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2e_ms))


def percentiles_ms(values: list[float]) -> dict[str, float | None]:
    """p50, p90, p99 and the mean of durations in seconds, in milliseconds (None for each without values)."""
    if not values:
        return {f"p{p}": None for p in PERCENTILES} | {"mean": None}
    arr = np.asarray(values) * 1000
    return {f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES} | {"mean": float(arr.mean())}


def summarize(results: list[RequestResult], elapsed: float, slo: Slo | None = None) -> dict:
    """One server's figures. Throughput is over the span from the first request sent to the last one ended."""
    ok = [r for r in results if r.ok]
    span = (max(r.end for r in ok) - min(r.start for r in ok)) if ok else elapsed
    span = max(span, 1e-9)
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error[:120]] = errors.get(r.error[:120], 0) + 1
    figures = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors,
        "duration_s": span,
        "wall_s": elapsed,
        "output_tokens": out_tokens,
        "prompt_tokens": in_tokens,
        "chunks_received": sum(len(r.chunk_times) for r in ok),
        "usage_reported": all(r.usage_reported for r in ok) if ok else False,
        "request_throughput": len(ok) / span,
        "output_throughput": out_tokens / span,
        "total_throughput": (in_tokens + out_tokens) / span,
        "ttft_ms": percentiles_ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": percentiles_ms([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": percentiles_ms([gap for r in ok for gap in r.itls]),
        "e2e_ms": percentiles_ms([r.e2e for r in ok]),
    }
    if slo is not None and slo.given:
        good = sum(slo.met(r) for r in results)
        figures["goodput"] = good / span
        figures["good_requests"] = good
    kinds = sorted({r.kind for r in results if r.kind})
    if kinds:  # burst's steady decodes and long prompts, or traffic classes (--class), apart
        figures["by_kind"] = {k: _class_figures([r for r in results if r.kind == k], span, slo) for k in kinds}
    return figures


def _class_figures(results: list[RequestResult], span: float, slo: Slo | None) -> dict:
    """One class's figures over the whole run's span (its throughput is its share of the run's)."""
    ok = [r for r in results if r.ok]
    figures = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "output_throughput": sum(r.output_tokens for r in ok) / span,
        "ttft_ms": percentiles_ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": percentiles_ms([r.tpot for r in ok if r.tpot is not None]),
        "e2e_ms": percentiles_ms([r.e2e for r in ok]),
    }
    if slo is not None and slo.given:
        figures["good_requests"] = sum(slo.met(r) for r in results)
        figures["goodput"] = figures["good_requests"] / span
    return figures


# each class's rows in the table (traffic classes, burst's kinds): label, path into its figures
CLASS_ROWS = [("completed", ("completed",)), ("failed", ("failed",)), ("output tok/s", ("output_throughput",)),
              ("goodput req/s", ("goodput",)), ("TTFT p50 ms", ("ttft_ms", "p50")), ("TTFT p90 ms", ("ttft_ms", "p90")),
              ("TTFT p99 ms", ("ttft_ms", "p99")), ("TPOT p50 ms", ("tpot_ms", "p50")),
              ("TPOT p99 ms", ("tpot_ms", "p99"))]

# (label, path into the figures, higher is better)
ROWS = [
    ("completed", ("completed",), True),
    ("failed", ("failed",), False),
    ("req/s", ("request_throughput",), True),
    ("output tok/s", ("output_throughput",), True),
    ("total tok/s", ("total_throughput",), True),
    ("goodput req/s", ("goodput",), True),
] + [
    (f"{name.upper()} p{p} ms", (f"{name}_ms", f"p{p}"), False) for name in LATENCIES for p in PERCENTILES
]


def _get(figures: dict, path: tuple[str, ...]):
    value = figures
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


def ratios(all_figures: list[dict]) -> list[dict]:
    """Each server's figures divided by the first server's, for every table row that both have."""
    base = all_figures[0]
    out = []
    for fig in all_figures:
        r = {}
        for label, path, _ in ROWS:
            a, b = _get(fig, path), _get(base, path)
            if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b:
                r[label] = a / b
        out.append(r)
    return out


def table(names: list[str], all_figures: list[dict]) -> str:
    """A text table: a row per figure, a column per server, the ratio to the first server beside each."""
    rel = ratios(all_figures)
    width = max(14, *(len(n) + 10 for n in names))
    lines = ["figure".ljust(16) + "".join(n.rjust(width) for n in names)]
    for label, path, _ in ROWS:
        cells = []
        for i, fig in enumerate(all_figures):
            v = _get(fig, path)
            if v is None:
                cells.append("-".rjust(width))
                continue
            text = f"{v:.0f}" if isinstance(v, int) else f"{v:.1f}"
            if i > 0 and label in rel[i]:
                text += f" ({rel[i][label]:.2f}x)"
            cells.append(text.rjust(width))
        if any(c.strip() != "-" for c in cells):
            lines.append(label.ljust(16) + "".join(cells))
    kinds = sorted({k for fig in all_figures for k in fig.get("by_kind", {})})
    for kind in kinds:
        lines.append(f"[{kind}]")
        for label, path in CLASS_ROWS:
            values = [_get(fig, ("by_kind", kind, *path)) for fig in all_figures]
            if all(v is None for v in values):
                continue
            cells = ["-" if v is None else f"{v:.0f}" if isinstance(v, int) else f"{v:.1f}" for v in values]
            lines.append(f"  {label}".ljust(16) + "".join(c.rjust(width) for c in cells))
    for name, fig in zip(names, all_figures):
        for err, count in fig["errors"].items():
            lines.append(f"  {name}: {count} failed: {err}")
    return "\n".join(lines)
