"""The step timeline of a run, offline: the dashboard's picture (one row per running request, one mark per engine
step: prefill chunk, decode, speculative, preempted) on a time axis, with the KV pool under it, saved as JSON and
drawn as a PNG. ``bench offline`` records its static and continuous runs; ``bench serve`` reads a JustAPI server's
``/engine/steps``; ``bench timeline`` draws a saved file again."""

from __future__ import annotations

import json

COLORS = {"prefill": "#4c78a8", "decode": "#54a24b", "spec": "#2d6a27", "preempted": "#e45756", "finished": "#222222"}
POOL_COLORS = ("#4c78a8", "#f58518", "#e4e4e4")  # held by requests, prefix cache (evictable), free


def step_entry(t: float, seconds: float, work) -> dict:
    """A step as the timeline keeps it: ``t`` seconds after the run started, lasting ``seconds`` (a StepWork)."""
    return {"t": t, "seconds": seconds, "cells": [list(c) for c in work.cells], "preempted": list(work.preempted),
            "finished": list(work.finished), "kv": list(work.kv_blocks)}


def from_step_records(records: list[dict]) -> list[dict]:
    """Steps from a JustAPI server's /engine/steps records (engine.step_log), timed from the first one."""
    records = [r for r in records if r.get("work")]
    if not records:
        return []
    t0 = records[0]["start"]
    return [{"t": r["start"] + r["commands"] - t0, "seconds": r["step"], "cells": r["work"]["cells"],
             "preempted": r["work"]["preempted"], "finished": r["work"]["finished"], "kv": r["work"]["kv_blocks"]}
            for r in records]


def assign_lanes(steps: list[dict]) -> tuple[list[list[int]], int]:
    """A row for each request while it runs (the lowest free one; given back when it finishes, is aborted or is
    preempted): each step's cells' rows, and the number of rows."""
    lanes: dict[str, int] = {}
    per_step, most = [], 0
    for step in steps:
        rows = []
        for rid, *_ in step["cells"]:
            if rid not in lanes:
                taken = set(lanes.values())
                lanes[rid] = next(k for k in range(len(taken) + 1) if k not in taken)
            rows.append(lanes[rid])
        most = max(most, len(lanes))
        per_step.append(rows)
        for rid in (*step["preempted"], *step["finished"]):
            lanes.pop(rid, None)
    return per_step, most


def draw_timeline(runs: dict[str, list[dict]], path: str, title: str = "") -> None:
    """One panel per run (name → steps) on a shared time axis, the KV pool under each, as a PNG at ``path``."""
    from .plot import pyplot

    plt = pyplot()
    from matplotlib.patches import Patch

    span = max((s["t"] + s["seconds"] for steps in runs.values() for s in steps), default=1.0)
    fig, axes = plt.subplots(2 * len(runs), 1, figsize=(12, 3.6 * len(runs)), squeeze=False,
                             gridspec_kw={"height_ratios": [4, 1] * len(runs)})
    for k, (name, steps) in enumerate(runs.items()):
        ax, pool = axes[2 * k][0], axes[2 * k + 1][0]
        _draw_rows(ax, steps)
        done = sum(len(s["finished"]) for s in steps)
        ax.set_title(f"{name}: {len(steps)} steps, {done} requests finished in {_end(steps):.2f} s", fontsize=10,
                     loc="left")
        _draw_pool(pool, steps)
        for a in (ax, pool):
            a.set_xlim(0, span)
        pool.set_xlabel("seconds")
    handles = [Patch(color=c, label=k if k != "spec" else "speculative") for k, c in COLORS.items()]
    handles += [Patch(color=c, label=n) for c, n in zip(POOL_COLORS, ("KV held", "KV prefix cache", "KV free"))]
    fig.legend(handles=handles, loc="upper right", ncol=4, fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _end(steps: list[dict]) -> float:
    return steps[-1]["t"] + steps[-1]["seconds"] if steps else 0.0


def _draw_rows(ax, steps: list[dict]) -> None:
    rows, num_rows = assign_lanes(steps)
    bars: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for step, lanes in zip(steps, rows):
        width = max(step["seconds"], 1e-4)
        for (rid, kind, *_), lane in zip(step["cells"], lanes):
            bars.setdefault((lane, kind), []).append((step["t"], width))
        for rid in step["preempted"]:
            bars.setdefault((-1, "preempted"), []).append((step["t"], width))
        ends = set(step["finished"])
        for (rid, *_), lane in zip(step["cells"], lanes):
            if rid in ends:  # a thin dark edge where a request retires: the next one in its row starts after it
                bars.setdefault((lane, "finished"), []).append((step["t"] + width * 0.8, width * 0.2))
    for (lane, kind), spans in bars.items():
        if lane >= 0:
            ax.broken_barh(spans, (lane - 0.4, 0.8), facecolors=COLORS.get(kind, "#000000"), linewidth=0)
    preemptions = bars.get((-1, "preempted"), [])
    for t, _ in preemptions:
        ax.axvline(t, color=COLORS["preempted"], linewidth=0.6, alpha=0.6)
    ax.set_ylim(num_rows - 0.5, -0.5)
    ax.set_ylabel("batch row")
    ax.tick_params(labelbottom=False)


def _draw_pool(ax, steps: list[dict]) -> None:
    if not steps:
        return
    ts = [s["t"] for s in steps] + [_end(steps)]
    parts = list(zip(*(s["kv"] for s in steps)))
    parts = [list(p) + [p[-1]] for p in parts]
    ax.stackplot(ts, *parts, colors=POOL_COLORS, step="post", linewidth=0)
    ax.set_ylim(0, sum(steps[0]["kv"]))
    ax.set_ylabel("KV blocks", fontsize=8)


def save(runs: dict[str, list[dict]], path: str) -> None:
    with open(path, "w") as f:
        json.dump({"runs": runs}, f, separators=(",", ":"))


def load(path: str) -> dict[str, list[dict]]:
    with open(path) as f:
        return json.load(f)["runs"]
