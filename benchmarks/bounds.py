"""What this machine allows each workload of benchmarks/workloads.txt, from its rates measured in the same run, and
how close a finished peers run came to it.

usage: python benchmarks/bounds.py [--model GGUF] [--json F] [--read-gbps B] [--gflops-bf16 G] [--gflops-fp32 G]
       python benchmarks/bounds.py report BOUNDS_JSON [RESULTS_DIR]

The machine (measured unless given): the read bandwidth (a 1 GiB fp32 tensor summed on all threads, best of 5, as
../shared/peers/machine_bench.py measures it) and torch's fp32 and bf16 matmul rates (square sizes 1024-4096, all
threads, best of 5 each).

**S1** (one stream) is bounded by memory: each decode token reads every weight once, as the file stores it (its
4- or 8-bit blocks with their scales: what any engine serving the file reads at least), and the K/V its context
holds (a bf16 cache; a sliding-window layer its window only), at the mean context of the run's decode steps. The
bound is the read bandwidth over those bytes, in decode tok/s (S1's figure: 1000 / TPOT p50).

**W1, W2, W3** (loaded) are bounded by arithmetic: every product counted at the measured bf16 rate (and the fp32
rate beside it), nothing else (no norms, no dispatch, no memory traffic), the lengths uniform over their ranges
(the expectation summed length by length). Per request of prompt length L and output length O:

    layers    2 FLOP per weight for each of the L + O - 1 tokens fed (the last output token is not fed back)
    head      2 FLOP per weight for each of the O positions whose logits are sampled
    attention 4 * heads * head_dim FLOP per layer and (query, visible key): QK^T and PV; query i sees i keys

W2's shared prefix is computed once (a perfect prefix cache); with arrivals (W3's Poisson rate) the run lasts at
least as long as they do (requests / rate), and the bound is the smaller of the two. In out tok/s.

``report``: each server's figure in a peers run's ``peers_<W>.json`` (``justapi bench serve --json``) as a
percentage of its bound, beside its ratio to the best peer (``peers_bench.sh`` prints it at the end of a run).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from justapi.plan.hardware import ModelShape

WORKLOADS = dict(line.split(" ", 1) for line in (Path(__file__).parent / "workloads.txt").read_text().splitlines())
@dataclass(frozen=True)
class Machine:
    read_gbps: float
    gflops_bf16: float
    gflops_fp32: float


@dataclass(frozen=True)
class Shape:
    """A workload's requests: ``prefix`` tokens shared by all (W2), then prompts and outputs over their ranges."""

    requests: int
    prompt: range
    output: range
    prefix: int = 0
    rate: float | None = None


def measure_machine(given: argparse.Namespace) -> Machine:
    from justapi.plan.hardware import measure_gflops, measure_read_gbps

    return Machine(given.read_gbps or measure_read_gbps(), given.gflops_bf16 or measure_gflops("bfloat16"),
                   given.gflops_fp32 or measure_gflops("float32"))


def span(text: str) -> range:
    lo, _, hi = text.partition(":")
    return range(int(lo), int(hi or lo) + 1)


def shape_of(name: str) -> Shape:
    """``name``'s requests, read from its ``justapi bench serve`` arguments (benchmarks/workloads.txt)."""
    p = argparse.ArgumentParser(add_help=False)
    for flag in ("--num-requests", "--num-prefixes", "--suffixes-per-prefix", "--prefix-len"):
        p.add_argument(flag, type=int, default=0)
    p.add_argument("--input-len", type=span)
    p.add_argument("--output-len", type=span)
    p.add_argument("--request-rate", type=float, default=None)
    w = p.parse_known_args(WORKLOADS[name].split())[0]
    if w.num_prefixes:  # shared-prefix: suffixes of --input-len after each prefix
        if w.num_prefixes != 1:
            raise SystemExit(f"{name}: one shared prefix expected, the arithmetic below counts it once")
        return Shape(w.suffixes_per_prefix, w.input_len, w.output_len, w.prefix_len, w.request_rate)
    return Shape(w.num_requests, w.input_len, w.output_len, 0, w.request_rate)


def request_flop(model: ModelShape, prefix: int, prompt: int, output: int) -> float:
    """FLOP of one request after a shared ``prefix`` already computed: its prompt and its decode."""
    fed = prompt + output - 1
    return 2 * model.layer_weights * fed + 2 * model.head_weights * output + model.attention(prefix, fed)


def s1_bound(model: ModelShape, shape: Shape, machine: Machine) -> dict:
    prompt, output = sum(shape.prompt) / len(shape.prompt), sum(shape.output) / len(shape.output)
    context = prompt + output / 2  # the mean context a decode step reads
    token = model.weight_bytes + model.kv_bytes(context)
    return dict(figure="decode tok/s", bytes_per_token=token, bound=machine.read_gbps * 1e9 / token,
                limit=f"{token / 1e6:.1f} MB a token at {machine.read_gbps:.1f} GB/s read")


def loaded_bound(model: ModelShape, shape: Shape, machine: Machine) -> dict:
    pairs = [(p, o) for p in shape.prompt for o in shape.output]
    flop = sum(request_flop(model, shape.prefix, p, o) for p, o in pairs) / len(pairs) * shape.requests
    if shape.prefix:
        flop += 2 * model.layer_weights * shape.prefix + model.attention(0, shape.prefix)
    out_tokens = shape.requests * sum(shape.output) / len(shape.output)
    arrivals = shape.requests / shape.rate if shape.rate else 0.0

    def at(gflops: float) -> float:
        return out_tokens / max(flop / (gflops * 1e9), arrivals)

    return dict(figure="out tok/s", tflop=flop / 1e12, bound=at(machine.gflops_bf16),
                bound_fp32=at(machine.gflops_fp32),
                limit=f"{flop / 1e12:.2f} TFLOP at {machine.gflops_bf16:.0f} GFLOP/s bf16"
                      + (f", arrivals over {arrivals:.0f} s" if arrivals else ""))


def bounds(model: ModelShape, machine: Machine) -> dict:
    out = {}
    for name in WORKLOADS:  # S1 one stream, the others loaded
        out[name] = (s1_bound if name == "S1" else loaded_bound)(model, shape_of(name), machine)
    return out


def figure(server: dict, name: str) -> float:
    """A server's figure in ``justapi bench serve``'s JSON: S1's decode tok/s, the others' out tok/s."""
    f = server["figures"]
    return 1000 / f["tpot_ms"]["p50"] if name == "S1" else f["output_throughput"]


def report(args) -> None:
    saved = json.loads(Path(args.bounds).read_text())
    results = Path(args.results)
    m = saved["machine"]
    print(f"# % of bound: {saved['model']}; read {m['read_gbps']:.1f} GB/s, bf16 {m['gflops_bf16']:.0f} and fp32 "
          f"{m['gflops_fp32']:.0f} GFLOP/s (measured {saved['measured']})")
    print(f"{'workload':8} {'server':16} {'figure':>10} {'bound':>9} {'% of bound':>10} {'x best peer':>11} failed")
    for name, b in saved["bounds"].items():
        path = results / f"peers_{name}.json"
        if not path.exists():
            continue
        servers = {s["name"]: s for s in json.loads(path.read_text())["servers"] if s["figures"].get("completed")}
        values = {n: figure(s, name) for n, s in servers.items()}
        complete = {n for n, s in servers.items() if not s["figures"].get("failed")}
        for n, v in values.items():  # the best peer among those that failed no request
            peers = [x for p, x in values.items() if not p.startswith("justapi") and p in complete]
            ratio = f"{v / max(peers):.2f}x" if peers and n.startswith("justapi") else ""
            failed = servers[n]["figures"].get("failed", 0)
            print(f"{name:8} {n:16} {v:10.1f} {b['bound']:9.1f} {100 * v / b['bound']:9.1f}% {ratio:>11} {failed:6}")
        print(f"{'':8} ({b['figure']}; bound: {b['limit']})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command")
    r = sub.add_parser("report", help="a peers run's figures as a percentage of their bounds")
    r.add_argument("bounds", help="this script's --json output, written in the same run")
    r.add_argument("results", nargs="?", default="bench_results", help="the directory of peers_<W>.json")
    ap.add_argument("--model", default=None, help="a GGUF (default: SmolLM2)")
    ap.add_argument("--json", default=None, help="also write the machine and the bounds here")
    ap.add_argument("--read-gbps", type=float, default=None, help="the read bandwidth, instead of measuring it")
    ap.add_argument("--gflops-bf16", type=float, default=None)
    ap.add_argument("--gflops-fp32", type=float, default=None)
    args = ap.parse_args()
    if args.command == "report":
        return report(args)
    from justapi.model.gguf_loader import default_model_path

    model = ModelShape.from_gguf(args.model or default_model_path())
    machine = measure_machine(args)
    found = bounds(model, machine)
    print(f"model {model.name}: {model.layer_weights / 1e6:.1f} M layer weights, head {model.head_weights / 1e6:.1f} M,"
          f" {model.weight_bytes / 1e6:.1f} MB of weights read a token")
    print(f"machine: read {machine.read_gbps:.1f} GB/s, matmul bf16 {machine.gflops_bf16:.0f} GFLOP/s, fp32 "
          f"{machine.gflops_fp32:.0f} GFLOP/s")
    for name, b in found.items():
        fp32 = f" (fp32: {b['bound_fp32']:.0f})" if "bound_fp32" in b else ""
        print(f"{name}: at most {b['bound']:.0f} {b['figure']}{fp32}: {b['limit']}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(model=model.name, machine=asdict(machine), bounds=found,
                                                   measured=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())),
                                              indent=1))


if __name__ == "__main__":
    main()
