"""`justapi bench` against `justapi serve` on loopback, a failing server, and in process (the command's ``main``
runs in the test process; so does the server, see server_helpers.InProcessServer)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import httpx
import pytest

from justapi.bench.workloads import WorkloadError, WorkloadSpec, arrival_times, build
from justapi.model.gguf_loader import open_gguf
from justapi.model.tokenizer import Tokenizer
from server_helpers import InProcessServer, labelled, metric

LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "bench-server.log"
    srv = InProcessServer(["--model", tiny_model, "--pool-blocks", "400"], str(log))
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return Tokenizer(tiny_model, open_gguf(tiny_model))


@pytest.fixture
def bench(capsys):
    """``justapi bench ARGS`` through the command's own ``main``: its exit status and what it printed."""
    from justapi.cli import main

    def run(*args: str) -> SimpleNamespace:
        capsys.readouterr()
        try:
            status = main(["bench", *args])
        except SystemExit as e:  # argparse's own errors
            status = e.code
        out, err = capsys.readouterr()
        return SimpleNamespace(returncode=status, stdout=out, stderr=err)

    return run


def counters(url: str) -> dict[str, float]:
    m = httpx.get(url + "/metrics").text
    return {k: metric(m, k) for k in ("justapi_generation_tokens_total", "justapi_prompt_tokens_total",
                                      "prefix_cache_hits")}


def test_serve_counts_add_up_against_a_real_server(bench, server, tiny_model, tmp_path):
    before = counters(server.url)
    out = tmp_path / "run.json"
    p = bench("serve", "--base-url", server.url, "--base-url", server.url, "--name", "first", "--name", "again",
              "--workload", "random", "--num-requests", "10", "--input-len", "8:40", "--output-len", "4:24",
              "--tokenizer", tiny_model, "--goodput", "ttft:60000", "tpot:60000", "--json", str(out))
    assert p.returncode == 0, p.stderr
    assert "output tok/s" in p.stdout and "again" in p.stdout
    data = json.loads(out.read_text())
    after = counters(server.url)
    figs = [s["figures"] for s in data["servers"]]
    for f in figs:
        assert f["completed"] == 10 and f["failed"] == 0 and f["usage_reported"]
        assert f["good_requests"] == 10  # generous SLOs: every request is good
        assert 0 < f["chunks_received"] <= f["output_tokens"]  # a chunk may carry several byte tokens
        for key in LATENCIES:
            assert f[key]["p50"] <= f[key]["p90"] <= f[key]["p99"], key
    # what the tool counted is what the server says it generated and read, over both runs
    assert (sum(f["output_tokens"] for f in figs)
            == after["justapi_generation_tokens_total"] - before["justapi_generation_tokens_total"])
    assert (sum(f["prompt_tokens"] for f in figs)
            == after["justapi_prompt_tokens_total"] - before["justapi_prompt_tokens_total"])
    assert figs[0]["output_tokens"] == figs[1]["output_tokens"]  # same seeded workload, ignore_eos
    assert data["servers"][1]["ratio_to_first"]["completed"] == 1.0


def test_multi_turn_conversations_extend_each_other(bench, server, tiny_model, tmp_path):
    before = counters(server.url)
    out = tmp_path / "mt.json"
    p = bench("serve", "--base-url", server.url, "--workload", "multi-turn", "--num-requests", "3", "--turns", "3",
              "--input-len", "40:60", "--output-len", "8", "--tokenizer", tiny_model, "--json", str(out))
    assert p.returncode == 0, p.stderr
    f = json.loads(out.read_text())["servers"][0]["figures"]
    assert f["completed"] == 9 and f["failed"] == 0
    # later turns resend the earlier ones: the server found them in its prefix cache
    assert counters(server.url)["prefix_cache_hits"] > before["prefix_cache_hits"]


def test_serve_saves_a_justapi_server_s_step_timeline(bench, server, tiny_model, tmp_path):
    p = bench("serve", "--base-url", server.url, "--num-requests", "6", "--input-len", "8:40", "--output-len", "4:20",
              "--tokenizer", tiny_model, "--timeline", str(tmp_path / "tl"), "--json", str(tmp_path / "run.json"))
    assert p.returncode == 0, p.stderr
    steps = json.loads((tmp_path / "tl.json").read_text())["runs"][server.url]
    finished = {rid for s in steps for rid in s["finished"]}
    assert len(finished) == 6
    # each request's timing names the engine request the step log shows (wall_breakdown splits TTFT by it)
    requests = json.loads((tmp_path / "run.json").read_text())["servers"][0]["figures"]["requests"]
    assert {r["id"] + "-0" for r in requests} == finished
    assert all(r["ok"] and 0 < r["ttft"] <= r["end"] - r["start"] for r in requests)
    assert steps[0]["t"] >= 0 and all(a["t"] <= b["t"] for a, b in zip(steps, steps[1:]))
    assert (tmp_path / "tl.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_writes_json_and_png(bench, server, tiny_model, tmp_path):
    out = tmp_path / "sweep"
    p = bench("sweep", "--base-url", server.url, "--name", "justapi", "--rates", "4,inf", "--workload",
              "shared-prefix", "--num-prefixes", "2", "--suffixes-per-prefix", "3", "--prefix-len", "30",
              "--input-len", "5:10", "--output-len", "4:12", "--tokenizer", tiny_model, "--out", str(out))
    assert p.returncode == 0, p.stderr
    data = json.loads((tmp_path / "sweep.json").read_text())
    points = data["servers"][0]["points"]
    assert [pt["rate"] for pt in points] == [4.0, "inf"]
    assert all(pt["figures"]["completed"] == 6 for pt in points)
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class _Failing(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        self._answer(404, b'{"error": "no"}')

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._answer(500, b'{"error": {"message": "boom"}}')

    def _answer(self, code: int, body: bytes):
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_errors_are_reported_as_failures_not_crashes(bench, server, tiny_model, tmp_path):
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Failing)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    bad = f"http://127.0.0.1:{httpd.server_address[1]}"
    out = tmp_path / "bad.json"
    try:
        p = bench("serve", "--base-url", server.url, "--base-url", bad, "--base-url", "http://127.0.0.1:9",
                  "--num-requests", "4", "--input-len", "8", "--output-len", "4", "--tokenizer", tiny_model,
                  "--json", str(out))
    finally:
        httpd.shutdown()
    assert p.returncode == 0, p.stderr
    good, failing, closed = (s["figures"] for s in json.loads(out.read_text())["servers"])
    assert good["completed"] == 4
    assert failing["failed"] == 4 and any("HTTP 500" in e for e in failing["errors"])
    assert closed["failed"] == 4 and any("Connect" in e for e in closed["errors"])
    assert "HTTP 500" in p.stdout


def test_time_limit_stops_the_run(bench, server, tiny_model, tmp_path):
    out = tmp_path / "limit.json"
    t0 = time.monotonic()
    p = bench("serve", "--base-url", server.url, "--num-requests", "6", "--request-rate", "0.5", "--arrival", "fixed",
              "--input-len", "8", "--output-len", "4", "--tokenizer", tiny_model, "--time-limit", "1",
              "--json", str(out))
    assert p.returncode == 0, p.stderr
    assert time.monotonic() - t0 < 60
    f = json.loads(out.read_text())["servers"][0]["figures"]
    assert f["completed"] + f["failed"] == 6 and f["errors"].get("time limit", 0) >= 4  # arrivals at 0, 2, 4.. s


def test_bad_options_are_clear_errors(bench, tiny_model, tmp_path):
    p = bench("serve", "--base-url", "127.0.0.1:8000", "--tokenizer", tiny_model)
    assert p.returncode == 2 and "must start with http://" in p.stderr
    p = bench("serve", "--base-url", "http://127.0.0.1:9", "--workload", "jsonl", "--tokenizer", tiny_model)
    assert p.returncode == 2 and "--dataset" in p.stderr
    p = bench("serve", "--base-url", "http://127.0.0.1:9", "--goodput", "latency:5", "--tokenizer", tiny_model)
    assert p.returncode == 2 and "--goodput" in p.stderr
    assert "Traceback" not in p.stderr


def test_workloads_are_seeded_and_shaped(tokenizer, tmp_path):
    a = build(WorkloadSpec("random", num_requests=5, input_len=(20, 30), seed=3), tokenizer)
    b = build(WorkloadSpec("random", num_requests=5, input_len=(20, 30), seed=3), tokenizer)
    assert [j.turns[0].prompt for j in a] == [j.turns[0].prompt for j in b]
    for job in a:
        n = len(tokenizer.encode(job.turns[0].prompt, add_special_tokens=False))
        assert 18 <= n <= 32  # lengths are in tokens of the served model (pieces may merge at the edges)
    shared = build(WorkloadSpec("shared-prefix", num_prefixes=2, suffixes_per_prefix=4, prefix_len=20,
                                input_len=(4, 8)), tokenizer)
    groups = {tuple(tokenizer.encode(j.turns[0].prompt, add_special_tokens=False)[:15]) for j in shared}
    assert len(shared) == 8 and len(groups) == 2
    burst = build(WorkloadSpec("burst", num_requests=20, steady_rate=2, burst_every=4, burst_size=3,
                               burst_input_len=200, output_len=(16, 16)), tokenizer)
    kinds = [j.kind for j in burst]
    assert kinds.count("steady") == 20 and kinds.count("burst") == 2 * 3  # bursts at 2 and 6 s, steady ones 0..9.5 s
    assert [j.at for j in burst] == sorted(j.at for j in burst)
    starts = arrival_times(a, 10.0, "poisson", 0)
    assert starts == sorted(starts) and starts[0] == 0 and starts != arrival_times(a, 10.0, "fixed", 0)
    assert arrival_times(a, float("inf"), "poisson", 0) == [0.0] * 5
    ds = tmp_path / "prompts.jsonl"
    ds.write_text('{"prompt": "hello", "max_tokens": 5}\n\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    jobs = build(WorkloadSpec("jsonl", path=str(ds)), tokenizer)
    assert jobs[0].turns[0].prompt == "hello" and jobs[0].turns[0].max_tokens == 5 and jobs[1].turns[0].messages
    ds.write_text('{"prompt": "ok"}\nnot json\n')
    with pytest.raises(WorkloadError, match="prompts.jsonl:2"):
        build(WorkloadSpec("jsonl", path=str(ds)), tokenizer)


def test_offline_reports_static_utilisation_next_to_continuous(bench, tiny_model, tmp_path):
    out = tmp_path / "offline.json"
    p = bench("offline", "--model", tiny_model, "--pool-blocks", "300", "--num-requests", "8", "--input-len", "8:30",
              "--output-len", "2:40", "--json", str(out), "--scheduling-policy", "priority",  # static: fcfs
              "--max-seqs", "4", "--timeline", str(tmp_path / "timeline"))
    assert p.returncode == 0, p.stderr
    runs = json.loads(out.read_text())["runs"]
    assert runs["static"]["completed"] == runs["continuous"]["completed"] == 8
    assert runs["static"]["output_tokens"] == runs["continuous"]["output_tokens"]
    assert 0 < runs["static"]["static_batch_utilization_U"] < 1  # output lengths 2..40 in one batch
    assert "static batching utilisation U" in p.stdout
    # the step timelines, one entry per engine step: each request's first token came with its prompt's last chunk,
    # every later one from a decode cell; static batches never overlap
    timeline = json.loads((tmp_path / "timeline.json").read_text())["runs"]
    for name, key in (("static batching", "static"), ("continuous batching", "continuous")):
        steps = timeline[name]
        assert len(steps) == runs[key]["engine_steps"]
        decodes = sum(1 for s in steps for c in s["cells"] if c[1] == "decode")
        assert decodes == runs[key]["output_tokens"] - 8
        assert len({rid for s in steps for rid in s["finished"]}) == 8
    static_rows = [{c[0] for c in s["cells"]} for s in timeline["static batching"]]
    assert max(len(r) for r in static_rows) == 4 and static_rows[-1].isdisjoint(static_rows[0])
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    again = bench("timeline", str(tmp_path / "timeline.json"), "--out", str(tmp_path / "again.png"))
    assert again.returncode == 0 and (tmp_path / "again.png").stat().st_size > 10_000
    assert bench("timeline", str(tmp_path / "missing.json")).returncode == 2


def test_extra_body_reaches_every_request(bench, server, tmp_path):
    """--extra-body: a structured-output constraint (and ignore_eos off) on every request of the workload."""
    out = tmp_path / "choice.json"
    extra = json.dumps({"structured_outputs": {"choice": ["yes", "no"]}, "ignore_eos": False})
    p = bench("serve", "--base-url", server.url, "--workload", "random", "--num-requests", "6", "--input-len", "8",
              "--output-len", "16", "--extra-body", extra, "--json", str(out))
    assert p.returncode == 0, p.stderr
    f = json.loads(out.read_text())["servers"][0]["figures"]
    assert f["completed"] == 6 and f["failed"] == 0
    assert f["output_tokens"] <= 6 * 4  # "yes" or "no" (at most 3 byte tokens) and the end, never 16 tokens
    assert bench("serve", "--base-url", server.url, "--extra-body", "[1]").returncode == 2


def test_traffic_classes_send_their_fields_and_are_reported_apart(bench, server, tiny_model, tmp_path):
    """--class: each class's requests carry its body fields (the server counts tokens per user) and its figures
    come apart in the report."""
    def per_user():
        m = httpx.get(server.url + "/metrics").text
        return {u: labelled(m, "justapi_tokens_served_by_user_total", user=u) if f'user="{u}"' in m else 0.0
                for u in ("alice", "bob")}

    before = per_user()
    out = tmp_path / "classes.json"
    p = bench("serve", "--base-url", server.url, "--tokenizer", tiny_model, "--input-len", "8:20", "--json", str(out),
              "--class", "name=chat,rate=20,requests=5,user=alice,priority=0,output=4:8",
              "--class", "name=batch,rate=10,requests=3,user=bob,priority=3,output=12", "--goodput", "ttft:60000")
    assert p.returncode == 0, p.stderr
    assert "[chat]" in p.stdout and "[batch]" in p.stdout
    f = json.loads(out.read_text())["servers"][0]["figures"]
    chat, batch = f["by_kind"]["chat"], f["by_kind"]["batch"]
    assert (chat["completed"], batch["completed"], f["completed"]) == (5, 3, 8)
    assert chat["good_requests"] == 5 and batch["ttft_ms"]["p50"] is not None
    after = per_user()
    served = {u: after[u] - before[u] for u in after}
    assert served["bob"] >= 3 * 12 + 3 * 8 - 6  # three requests of 12 output tokens plus their prompts
    assert served["alice"] > 0
    bad = bench("serve", "--base-url", server.url, "--tokenizer", tiny_model, "--class", "name=x,rate=0,requests=2")
    assert bad.returncode == 2 and "--class" in bad.stderr and "Traceback" not in bad.stderr
    sweep = bench("sweep", "--base-url", server.url, "--tokenizer", tiny_model, "--rates", "1,2", "--out",
                  str(tmp_path / "s"), "--class", "name=x,rate=5,requests=2")  # rates would change nothing
    assert sweep.returncode == 2 and "own arrival times" in sweep.stderr and "Traceback" not in sweep.stderr


def test_wall_breakdown_tells_the_attention_kernels_apart_by_the_line_a_sample_is_on():
    """benchmarks/wall_breakdown.py splits attention samples by the source line of attention.py they were on: each
    line that calls the decode kernel, the C++ prefill kernel or torch's fused path lands in its part."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent.parent / "benchmarks" / "wall_breakdown.py"
    spec = importlib.util.spec_from_file_location("wall_breakdown", path)
    wb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(wb)
    lines = wb.ATTENTION_LINES
    calls = {part: [i + 1 for i, text in enumerate(lines) if f"kernels.{kernel}(" in text]
             for part, kernel in (("attention: decode", "decode_attention"),
                                  ("attention: prompt chunks", "prefill_attention"))}
    assert len(calls["attention: decode"]) == 2 and len(calls["attention: prompt chunks"]) == 1
    for part, numbers in calls.items():
        for n in numbers:
            assert wb.attention_part("paged_attention", str(n)) == part
    assert wb.attention_part("_sequence_attention_fused", None) == "attention: prompt chunks"
    assert wb.attention_part("_gather_blocks", "1") == "attention: K/V gathers"
    assert wb.attention_part("paged_attention", "1") == "attention: other"
    frames = ["Thread._bootstrap (threading.py:1)", "step (justapi/engine/engine_core.py:10)",
              f"paged_attention (justapi/model/attention.py:{calls['attention: decode'][0]})"]
    assert wb.engine_category(frames) == ("attention: decode", None)


def test_compare_gives_after_over_before_in_both_orders(bench, tmp_path):
    """`justapi bench compare`: after / before of each workload from both passes (peers_bench.sh's main pass and the
    reversed one), their geometric mean; files without both servers are a clear error (exit 2)."""
    def figures(tok_s: float, ttft: float, tpot: float) -> dict:
        return {"output_throughput": tok_s, "ttft_ms": {"p50": ttft}, "tpot_ms": {"p50": tpot, "p99": 2 * tpot}}

    def write(name: str, after: dict, before: dict) -> None:
        servers = [{"name": "justapi", "figures": after}, {"name": "justapi-before", "figures": before}]
        (tmp_path / name).write_text(json.dumps({"servers": servers}))

    write("peers_W1.json", figures(200.0, 100.0, 50.0), figures(100.0, 100.0, 50.0))
    write("peers_W1_reversed.json", figures(100.0, 100.0, 50.0), figures(200.0, 100.0, 50.0))
    write("peers_S1.json", figures(1.0, 30.0, 10.0), figures(1.0, 30.0, 20.0))
    write("peers_S1_reversed.json", figures(1.0, 30.0, 10.0), figures(1.0, 30.0, 20.0))
    p = bench("compare", str(tmp_path))
    rows = {tuple(line.split()[:3]): line.split()[-3:] for line in p.stdout.splitlines()[1:]}
    assert p.returncode == 0 and rows[("W1", "out", "tok/s")] == ["2.000x", "0.500x", "1.000x"]
    assert rows[("S1", "TPOT", "p50")] == ["0.500x", "0.500x", "0.500x"]
    (tmp_path / "peers_W1.json").write_text(json.dumps({"servers": [{"name": "justapi", "figures": {}}]}))
    p = bench("compare", str(tmp_path))
    assert p.returncode == 2 and "justapi-before" in p.stderr and "Traceback" not in p.stderr


def test_bounds_count_a_token_s_bytes_and_a_workload_s_products(tiny_model, tmp_path, capsys, monkeypatch):
    """benchmarks/bounds.py: S1's bytes a token are every layer tensor and the head as stored plus the K/V of the
    mean context; the loaded workloads' attention arithmetic in closed form equals the sum over each query's keys
    (windows included); W2's shared prefix counted once; `report` gives a figure as a share of its bound."""
    import importlib.util
    from pathlib import Path

    from justapi.model.gguf_loader import open_gguf

    path = Path(__file__).parent.parent / "benchmarks" / "bounds.py"
    spec = importlib.util.spec_from_file_location("bounds", path)
    b = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bounds", b)  # its dataclasses look their module up
    spec.loader.exec_module(b)
    from justapi.model.gguf_loader import read_model_config
    from justapi.plan.hardware import ModelShape

    model = ModelShape.from_gguf(tiny_model)
    cfg = read_model_config(open_gguf(tiny_model), tiny_model)
    stored = {t.name: int(t.n_bytes) for t in open_gguf(tiny_model).tensors}
    head = stored.get("output.weight", stored["token_embd.weight"])
    assert model.weight_bytes == sum(n for k, n in stored.items() if k.startswith("blk.")) + head
    keys = sum(p + 1 for p in range(5, 5 + 7))  # queries at positions 5..11
    assert model.attention(5, 7) == 4 * cfg.num_heads * cfg.head_dim * cfg.num_layers * keys
    windowed = dataclasses.replace(model, windows=(4,) + (None,) * (cfg.num_layers - 1))  # layer 0 windowed
    window_keys = sum(min(p + 1, 4) for p in range(5, 12))
    per_layer = 4 * cfg.num_heads * cfg.head_dim
    assert windowed.attention(5, 7) == per_layer * (window_keys + (cfg.num_layers - 1) * keys)
    assert windowed.kv_bytes(10) == 2 * cfg.num_kv_heads * cfg.head_dim * 2 * (4 + 10 * (cfg.num_layers - 1))
    machine = b.Machine(read_gbps=10.0, gflops_bf16=100.0, gflops_fp32=50.0)
    s1 = b.s1_bound(model, b.Shape(1, range(128, 129), range(128, 129)), machine)
    assert s1["bytes_per_token"] == model.weight_bytes + model.kv_bytes(128 + 64)
    assert s1["bound"] == pytest.approx(10e9 / s1["bytes_per_token"])
    shared = b.loaded_bound(model, b.Shape(4, range(8, 9), range(2, 3), prefix=100), machine)
    alone = b.loaded_bound(model, b.Shape(4, range(8, 9), range(2, 3)), machine)
    prefix_flop = 2 * model.layer_weights * 100 + model.attention(0, 100)
    later_keys = 4 * (model.attention(100, 9) - model.attention(0, 9))  # the suffixes see the prefix's keys too
    assert shared["tflop"] * 1e12 == pytest.approx(alone["tflop"] * 1e12 + prefix_flop + later_keys)
    assert shared["bound"] == pytest.approx(4 * 2 / (shared["tflop"] * 1e12 / 100e9))
    w2 = b.shape_of("W2")
    assert (w2.requests, w2.prefix, w2.prompt, w2.output) == (64, 400, range(32, 33), range(64, 65))
    saved = tmp_path / "bounds.json"
    saved.write_text(json.dumps(dict(model="m", machine=dataclasses.asdict(machine), measured="now",
                                     bounds={"S1": s1})))
    servers = [{"name": "justapi", "figures": {"completed": 4, "tpot_ms": {"p50": 1000 / (s1["bound"] / 2)}}},
               {"name": "llama.cpp", "figures": {"completed": 4, "tpot_ms": {"p50": 1000 / (s1["bound"] / 4)}}},
               # a faster peer that failed requests gives no ratio
               {"name": "other", "figures": {"completed": 3, "failed": 1, "tpot_ms": {"p50": 1.0}}}]
    (tmp_path / "peers_S1.json").write_text(json.dumps({"servers": servers}))
    capsys.readouterr()
    b.report(argparse.Namespace(bounds=str(saved), results=str(tmp_path)))
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("S1") and "justapi" in x)
    assert "50.0%" in line and "2.00x" in line
