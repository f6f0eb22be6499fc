"""The capacity planner: the cost model's fit, the simulator running the engine's own Scheduler on virtual time,
and a recorded run of the real engine replayed to the same schedule."""

from __future__ import annotations

import inspect
import random

import pytest

from justapi.bench.workloads import WorkloadSpec
from justapi.config import SchedulerConfig
from justapi.plan.cost_model import FEATURES, KNOTS, CostModel, CostModelError, StepShape, fit
from justapi.plan.simulator import SimRequest, Simulation, SimulationError
from justapi.sampling_params import SamplingParams


def costs(base=0.0, per_row=0.0, per_context=0.0, per_seq=0.0) -> CostModel:
    coef = [0.0] * len(FEATURES)
    coef[FEATURES.index("base")], coef[FEATURES.index("per_row")] = base, per_row
    coef[FEATURES.index("per_context")], coef[FEATURES.index("per_seq")] = per_context, per_seq
    return CostModel(tuple(coef), "test", "test", 1)


def test_shape_of_cells():
    # a 64-token chunk starting at 0, a 36-token chunk starting at 64, two decodes at contexts 10 and 99
    shape = StepShape.of_cells([("a", "prefill", 0, 64, 0), ("b", "prefill", 64, 36, 0),
                                ("c", "decode", 9, 1, 0), ("d", "spec", 95, 4, 2)])
    assert shape == StepShape(rows=105, decodes=2, decode_context=10 + 99, prefill_tokens=100,
                              prefill_pairs=64 * 65 // 2 + 36 * 64 + 36 * 37 // 2, seqs=4)


def test_rows_sharing_a_prompt_prefix_read_its_blocks_once():
    from justapi.core.router import block_chain

    def block_keys(ids):
        return list(block_chain(ids, 16))

    prefix = list(range(100, 132))  # two blocks of 16
    blocks = {"a": block_keys(prefix + [1] * 20), "b": block_keys(prefix + [2] * 20), "c": block_keys([3] * 52)}
    cells = [("a", "decode", 60, 1, 0), ("b", "decode", 55, 1, 0), ("c", "decode", 70, 1, 0)]
    assert StepShape.of_cells(cells).decode_context == 61 + 56 + 71
    # b's first two blocks are a's; b's third (its own tokens) and c's blocks are read apart
    shared = StepShape.of_cells(cells, blocks)
    assert (shared.decode_context, shared.shared_context) == (61 + (56 - 32) + 71, 32)
    assert StepShape.of_cells(cells[:1] + [("b", "decode", 20, 1, 0)], blocks).decode_context == 61 + (21 - 16)


def test_fit_recovers_a_model_of_its_own_form_and_round_trips(tmp_path):
    rng = random.Random(0)
    truth = [0.004, 2e-4, -1e-4, 3e-5, 0.0, -2e-5, 0.0, 1e-7, 2e-9, 5e-5, 3e-8]
    assert len(truth) == len(FEATURES)
    shapes = []
    for _ in range(200):
        decodes = rng.randint(0, 64)
        prefill = rng.choice([0, 0, rng.randint(1, 512)])
        shapes.append(StepShape(decodes + prefill, decodes, decodes * rng.randint(1, 900), prefill,
                                prefill * rng.randint(0, 600) + prefill * (prefill + 1) // 2,
                                decodes + (prefill > 0), decodes * rng.randint(0, 400)))
    seconds = [sum(c * f for c, f in zip(truth, s.features())) for s in shapes]
    assert min(seconds) > 0
    model = fit(shapes, seconds, "m.gguf", "cpu", 2)
    assert model.coefficients == pytest.approx(truth, rel=1e-6, abs=1e-12)
    assert model.error.median_rel < 1e-9 and abs(model.error.total_rel) < 1e-9
    path = str(tmp_path / "plan" / "m.json")
    model.save(path)
    assert CostModel.load(path) == model


def test_fit_and_load_refuse_what_they_cannot_use(tmp_path):
    shape = StepShape(1, 1, 10, 0, 0, 1)
    with pytest.raises(CostModelError, match="too few"):
        fit([shape] * 10, [0.01] * 10, "m", "cpu", 1)
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "something else"}')
    with pytest.raises(CostModelError, match="not a cost model"):
        CostModel.load(str(bad))
    with pytest.raises(CostModelError, match="cannot read"):
        CostModel.load(str(tmp_path / "missing.json"))
    assert len(KNOTS) + 6 == len(FEATURES)


def test_simulation_runs_the_engines_scheduler():
    from justapi.core.scheduler import Scheduler
    from justapi.engine.engine_core import EngineCore

    sim = Simulation(SchedulerConfig(num_blocks=64), costs(base=0.01))
    assert type(sim.scheduler) is Scheduler
    assert inspect.getmodule(type(sim.scheduler).schedule).__name__ == "justapi.core.scheduler"
    import justapi.plan as plan

    # no class of plan/ is (or derives from) a scheduler of its own: the engine's is the only one
    for name in ("replica", "simulator", "search"):
        module = __import__(f"justapi.plan.{name}", fromlist=["_"])
        own = [c for _, c in inspect.getmembers(module, inspect.isclass) if c.__module__ == module.__name__]
        assert not [c for c in own if "schedule" in vars(c) or issubclass(c, Scheduler)], own
    assert plan is not None and EngineCore is not None


def test_one_request_costs_what_the_model_says():
    # chunk 64: a 100-token prompt takes steps of 64 and 36 rows, then 9 decode steps of one row
    sim = Simulation(SchedulerConfig(num_blocks=64, chunk_size=64, max_prefill=64), costs(base=0.01, per_row=0.001))
    run = sim.run([SimRequest(list(range(2, 102)), max_tokens=10)])
    res = run.results[0]
    assert res.ok and res.output_tokens == 10
    assert res.ttft == pytest.approx(0.074 + 0.046)
    assert res.e2e == pytest.approx(0.12 + 9 * 0.011)
    assert [len(s.cells) for s in run.steps] == [1] * 11


def test_the_client_holds_max_concurrency_slots():
    sim = Simulation(SchedulerConfig(num_blocks=64), costs(base=0.01))
    reqs = [SimRequest([2 + i, 3, 4], max_tokens=5, at=0.0) for i in range(3)]
    run = sim.run(reqs, max_concurrency=1)
    starts = [r.start for r in run.results]
    assert starts == pytest.approx([0.0, 0.05, 0.10])  # each sent when the one before ends (5 steps of 10 ms)
    assert all(r.ttft == pytest.approx(0.01) for r in run.results)


def test_a_request_that_can_never_fit_is_refused_and_the_rest_run():
    sim = Simulation(SchedulerConfig(num_blocks=4, block_size=16, max_model_len=64), costs(base=0.01))
    run = sim.run([SimRequest(list(range(100)), 4), SimRequest([5, 6], 4)], max_concurrency=1)
    assert not run.results[0].ok and "prompt" in run.results[0].error.lower()
    assert run.results[1].ok


def test_speculation_is_refused():
    with pytest.raises(SimulationError, match="speculative"):
        Simulation(SchedulerConfig(num_blocks=64, spec_method="ngram"), costs(base=0.01))


def _recorded_run(tiny_model):
    """A real engine (the tiny model) over requests arriving at given steps, in a pool small enough to preempt,
    some prompts sharing a prefix: each step's cells, and the requests with the step each arrived before."""
    from justapi import LLM

    llm = LLM(tiny_model, pool_blocks=14, block_size=16, max_seqs=4, chunk_size=48, show_progress=False)
    engine = llm.engine
    rng = random.Random(3)
    prefix = [rng.randrange(3, 250) for _ in range(40)]
    arrivals: dict[int, list[SimRequest]] = {}
    for i in range(10):
        own = [rng.randrange(3, 250) for _ in range(rng.randint(5, 60))]
        prompt = (prefix + own) if i % 3 == 0 else own
        at = 0 if i < 3 else rng.randint(1, 30)
        arrivals.setdefault(at, []).append(SimRequest(prompt, rng.randint(3, 40), at=float(at)))
    cells, k, added = [], 0, 0
    total = sum(len(v) for v in arrivals.values())
    while added < total or engine.has_unfinished:
        for req in arrivals.get(k, []):
            engine.add_request(f"sim-{added}", req.prompt, SamplingParams(max_tokens=req.max_tokens,
                                                                          ignore_eos=True, temperature=0.0))
            added += 1
        engine.step()
        assert engine.last_step.cells, "the recorded run must never idle (the replay's steps are its clock)"
        cells.append(tuple(engine.last_step.cells))
        k += 1
    requests = [r for at in sorted(arrivals) for r in arrivals[at]]
    return engine.scheduler, cells, requests


def test_a_recorded_run_replays_to_the_same_schedule(tiny_model):
    scheduler, recorded, requests = _recorded_run(tiny_model)
    assert scheduler.stats.num_preemptions > 0 and scheduler.cache.hits > 0  # the run exercises both
    sim = Simulation(scheduler.config, costs(base=1.0))  # every step one second: step k starts at k
    run = sim.run(requests)
    assert [s.cells for s in run.steps] == recorded
    assert run.preemptions == scheduler.stats.num_preemptions
    assert all(r.ok for r in run.results)


def test_replicas_share_the_load_and_the_router_keeps_a_prefix_together():
    rng = random.Random(1)
    prefixes = [[rng.randrange(3, 250) for _ in range(64)] for _ in range(2)]
    reqs = [SimRequest(prefixes[i // 2 % 2] + [rng.randrange(3, 250) for _ in range(8)], 16, at=0.01 * i)
            for i in range(16)]
    config = SchedulerConfig(num_blocks=256, max_seqs=4)
    model = costs(base=0.005, per_row=0.0005)
    one = Simulation(config, model).run(reqs)
    two = Simulation(config, model, replicas=2).run(reqs)
    assert all(r.ok for r in one.results + two.results)
    assert two.elapsed < 0.75 * one.elapsed
    routed = Simulation(config, model, replicas=2)
    routed.run(reqs)
    # each replica computed one prefix once: the other prefix's requests went elsewhere (round robin sends
    # each prefix to both)
    for replica in routed.replicas:
        assert replica.scheduler.cache.hits >= 6 * 4  # 7 later requests of its prefix hit its 4 blocks
    spread = Simulation(config, model, replicas=2, router="round-robin")
    spread.run(reqs)
    assert sum(r.scheduler.cache.hits for r in spread.replicas) < sum(r.scheduler.cache.hits for r in routed.replicas)


def test_static_batching_waits_for_the_whole_batch():
    reqs = [SimRequest([2 + i, 3, 4], max_tokens=4 if i % 2 else 20, at=0.0) for i in range(8)]
    config = SchedulerConfig(num_blocks=64, max_seqs=4)
    cont = Simulation(config, costs(base=0.01)).run(reqs)
    static_sim = Simulation(config, costs(base=0.01), static_batching=True)
    static = static_sim.run(reqs)
    assert static.elapsed > cont.elapsed
    assert static_sim.scheduler.stats.batch_utilizations == pytest.approx([(4 + 20) * 2 / (4 * 20)] * 2)


def test_the_roofline_of_a_step():
    from justapi.plan.hardware import HARDWARE, RooflineCosts, model_shape

    shape, h200 = model_shape("llama-3.1-8b"), HARDWARE["h200"]
    assert shape.weight_bytes == pytest.approx(2 * (6.98e9 + 0.525e9), rel=0.01)  # 8.0 B weights, bf16
    one = RooflineCosts(shape, h200)
    decode = StepShape(rows=1, decodes=1, decode_context=100, prefill_tokens=0, prefill_pairs=0, seqs=1)
    read = shape.weight_bytes + shape.kv_bytes_per_token() * 100
    assert one.seconds(decode) == pytest.approx(read / (4800e9 * 0.8) + 0.002)  # memory-bound
    prefill = StepShape(rows=8192, decodes=0, decode_context=0, prefill_tokens=8192, prefill_pairs=8192 * 8193 // 2,
                        seqs=1)
    flop = 2 * shape.layer_weights * 8192 + 2 * shape.head_weights + shape.attn_flop * 32 * 8192 * 8193 // 2
    assert one.seconds(prefill) == pytest.approx(flop / (989e12 * 0.6) + 0.002)  # compute-bound
    two = RooflineCosts(shape, h200, tp=2)
    ring = 2 * 32 * (8e-6 + 2 * 1 / 2 * 4096 * 2 / 450e9)
    assert two.seconds(decode) == pytest.approx(read / 2 / (4800e9 * 0.8) + 0.002 + ring)
    with pytest.raises(ValueError, match="no room"):
        RooflineCosts(model_shape("llama-3.1-70b"), HARDWARE["h100"]).kv_pool_blocks(16)
    assert RooflineCosts(model_shape("llama-3.1-70b"), HARDWARE["h100"], tp=4).kv_pool_blocks(16) > 10_000


def test_the_search_finds_the_fewest_replicas_that_meet_the_slo():
    from dataclasses import replace

    from justapi.plan.search import Candidate, SloTargets, Space, fewest_replicas, simulate

    rng = random.Random(5)
    reqs = [SimRequest([rng.randrange(3, 250) for _ in range(64)], 32, at=0.02 * i) for i in range(60)]
    space = Space(lambda tp: costs(base=0.004, per_row=0.0004), lambda tp: 512,
                  lambda rate: [replace(r, at=r.at * 50 / rate) for r in reqs], SchedulerConfig(num_blocks=512),
                  max_seqs=(8,), max_replicas=16)
    slo = SloTargets.parse("ttft_p99=100,tpot_p99=20")
    best = fewest_replicas(space, Candidate(1, 512, 8), 50.0, slo)
    assert best is not None and best.meets and best.candidate.replicas > 1
    fewer = simulate(space, replace(best.candidate, replicas=best.candidate.replicas - 1), 50.0, slo)
    assert not fewer.meets
    with pytest.raises(ValueError, match="ttft_p99"):
        SloTargets.parse("ttft=5")


def test_justapi_plan_answers_for_a_described_device(tmp_path, capsys):
    from justapi.cli import main

    out = tmp_path / "curve.png"
    code = main(["plan", "--model", "llama-3.1-8b", "--hardware", "h200", "--rate", "4", "--slo",
                 "ttft_p99=2000,tpot_p99=100", "--tp", "1", "--chunk-sizes", "512", "--max-seqs", "32",
                 "--num-requests", "40", "--out", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert "cheapest: 1 replica x TP 1" in printed.out and "static batching there" in printed.out
    assert out.read_bytes()[:4] == b"\x89PNG"
    assert main(["plan", "--model", "llama-3.1-8b", "--hardware", "tpu9", "--rate", "4", "--slo",
                 "ttft_p99=2000"]) == 2
    assert "unknown hardware 'tpu9'" in capsys.readouterr().err


def test_the_front_serves_one_request_after_another_and_the_tail_delays_what_clients_see():
    sim = Simulation(SchedulerConfig(num_blocks=64), costs(base=0.01), front_s=0.005, tail_s=0.002)
    run = sim.run([SimRequest([2, 3, 4], 3), SimRequest([5, 6, 7], 3)], max_concurrency=1)
    first, second = run.results
    assert first.ttft == pytest.approx(0.005 + 0.01 + 0.002)
    assert first.e2e == pytest.approx(0.005 + 3 * 0.01 + 0.002)
    assert second.start == pytest.approx(first.end)  # its slot came back when the client heard the end
    both = Simulation(SchedulerConfig(num_blocks=64), costs(base=0.01), front_s=0.005).run(
        [SimRequest([2, 3, 4], 3), SimRequest([5, 6, 7], 3)])
    # sent together: the second waits for the front, reaches the engine during the first's prompt step
    assert [r.ttft for r in both.results] == pytest.approx([0.015, 0.025])


def test_disaggregated_requests_move_to_a_decode_worker_after_their_first_token():
    config = SchedulerConfig(num_blocks=64, chunk_size=64, max_prefill=64)
    sim = Simulation(config, costs(base=0.01), decoders=1, transfer_s=lambda tokens: 0.001 * tokens)
    run = sim.run([SimRequest(list(range(2, 42)), max_tokens=5)])
    res = run.results[0]
    assert res.ok and res.output_tokens == 5
    assert res.ttft == pytest.approx(0.01)  # the prefill worker's one step
    assert res.e2e == pytest.approx(0.01 + 0.040 + 4 * 0.01)  # the KV of 40 tokens moved, then 4 decode steps
    prefill, decode = sim.replicas[0].scheduler, sim.decoders[0].scheduler
    assert [c[1] for s in run.steps for c in s.cells] == ["prefill"] + ["decode"] * 4
    assert prefill.stats.num_preemptions == 0 and not prefill.handoffs and not prefill.running
    assert prefill.pool.num_used == prefill.num_cached_blocks  # its prompt's blocks went to its prefix cache
    assert not decode.running and sim.pd.requests == {}


def test_plan_simulate_replays_a_recorded_bench_run(tiny_model, tmp_path, capsys):
    import json

    from justapi.cli import main

    model = costs(base=0.01, per_row=0.001)
    model = CostModel(model.coefficients, "tiny", "cpu", 1, settings={"num_blocks": 256, "max_model_len": 1024,
                                                                      "front_s": 0.002, "tail_s": 0.001})
    model.save(str(tmp_path / "costs.json"))
    timings = [{"id": f"r{i}", "ok": True, "start": 100.0 + 0.5 * i, "ttft": 0.1, "end": 101.0 + i,
                "prompt_tokens": 20 + i, "output_tokens": 5} for i in range(3)]
    timings.append({"id": "failed", "ok": False, "start": 100.2, "ttft": None, "end": 100.3, "prompt_tokens": 0,
                    "output_tokens": 0})
    (tmp_path / "run.json").write_text(json.dumps({"servers": [{"figures": {"requests": timings}}]}))
    argv = ["plan", "simulate", "--model", tiny_model, "--costs", str(tmp_path / "costs.json"), "--trace",
            str(tmp_path / "run.json"), "--json", str(tmp_path / "out.json")]
    assert main(argv) == 0, capsys.readouterr().err
    figures = json.loads((tmp_path / "out.json").read_text())
    assert figures["completed"] == 3 and figures["output_tokens"] == 15 and figures["prompt_tokens"] == 63
    # the first request alone: the front, its prompt step (20 rows), the tail
    assert figures["ttft_ms"]["p50"] == pytest.approx(2 + 10 + 21 + 1, abs=0.5)
    (tmp_path / "bad.json").write_text("{}")
    assert main(argv[:-4] + ["--trace", str(tmp_path / "bad.json")]) == 2
    assert "not a bench serve --json file" in capsys.readouterr().err


def test_justapi_plan_answers_on_this_machine_from_its_cost_model(tiny_model, tmp_path, capsys):
    from justapi.cli import main

    base = costs(base=0.01, per_row=0.0005)
    CostModel(base.coefficients, "tiny", "cpu", 2, settings={"num_blocks": 400, "max_model_len": 1024,
                                                            "front_s": 0.001}).save(str(tmp_path / "c.json"))
    argv = ["plan", "--model", tiny_model, "--costs", str(tmp_path / "c.json"), "--rate", "20", "--slo",
            "ttft_p99=300,tpot_p99=40", "--chunk-sizes", "256", "--max-seqs", "8", "--num-requests", "60",
            "--input-len", "32:128", "--output-len", "8:32", "--out", str(tmp_path / "c.png")]
    assert main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "x TP 1" in out and "TP 2" not in out  # tensor parallelism is not offered on this machine's cores
    assert main(argv + ["--disaggregate"]) == 2
    assert "described devices" in capsys.readouterr().err


def test_the_search_weighs_disaggregation_on_a_described_device(tmp_path, capsys):
    from justapi.cli import main
    from justapi.plan.answer import workload
    from justapi.plan.hardware import HARDWARE, RooflineCosts, model_shape
    from justapi.plan.search import Candidate, SloTargets, Space, fewest_split

    shape, h100 = model_shape("llama-3.1-8b"), HARDWARE["h100"]
    space = Space(lambda tp: RooflineCosts(shape, h100, tp),
                  lambda tp: RooflineCosts(shape, h100, tp).kv_pool_blocks(16),
                  workload(WorkloadSpec(num_requests=40), shape.vocab), SchedulerConfig(num_blocks=1),
                  transfer=lambda cand: RooflineCosts(shape, h100, cand.tp).transfer_seconds)
    slo = SloTargets.parse("ttft_p99=3000,tpot_p99=100")
    split = fewest_split(space, Candidate(1, 2048, 64), 8.0, slo, at_most=4)
    assert split is not None and split.meets
    assert (split.candidate.replicas, split.candidate.decoders) == (1, 1)  # the fewest workers: one of each
    assert split.figures["completed"] == 40
    # one colocated device meets it too, and costs less: the answer is colocated, disaggregation not worth trying
    assert main(["plan", "--model", "llama-3.1-8b", "--hardware", "h100", "--rate", "8", "--slo",
                 "ttft_p99=3000,tpot_p99=100", "--tp", "1", "--chunk-sizes", "2048", "--max-seqs", "64",
                 "--num-requests", "40", "--disaggregate", "--max-replicas", "4",
                 "--out", str(tmp_path / "d.png")]) == 0
    assert "cheapest: 1 replica x TP 1 (1 devices)" in capsys.readouterr().out


def test_plan_profile_fits_a_real_server_then_simulates_on_it(tiny_model, tmp_path, capsys):
    """End to end: `justapi plan profile` starts `justapi serve` (a child on loopback), fits its step log, and
    `justapi plan simulate` reads the saved model."""
    import json

    from justapi.cli import main

    out = tmp_path / "tiny.json"
    assert main(["plan", "profile", "--out", str(out), "--scale", "0.25", "--records", str(tmp_path / "r.json"),
                 "--", "--model", tiny_model, "--pool-blocks", "512", "--max-seqs", "8"]) == 0, \
        capsys.readouterr().err
    model = CostModel.load(str(out))
    assert model.settings["num_blocks"] == 512 and model.settings["max_seqs"] == 8
    assert model.error.steps >= 40 and model.front_s > 0
    records = json.loads((tmp_path / "r.json").read_text())
    assert sum(1 for r in records if r["work"] and r["work"]["cells"]) == model.error.steps
    capsys.readouterr()
    assert main(["plan", "simulate", "--model", tiny_model, "--costs", str(out), "--num-requests", "12",
                 "--input-len", "16:64", "--output-len", "4:16", "--max-concurrency", "4"]) == 0
    assert "completed" in capsys.readouterr().out



def test_the_time_limit_ends_what_has_not_ended():
    sim = Simulation(SchedulerConfig(num_blocks=64), costs(base=0.01), front_s=0.001)
    reqs = [SimRequest([2, 3, 4], 50, at=0.0), SimRequest([5, 6, 7], 5, at=0.05), SimRequest([8, 9], 5, at=10.0)]
    run = sim.run(reqs, max_concurrency=2, time_limit=0.2)
    done, cut, unsent = run.results
    assert run.elapsed == pytest.approx(0.2)
    assert not cut.ok or cut.end <= 0.2
    assert not done.ok and done.error == "time limit" and not unsent.ok and unsent.error == "time limit"
    assert all(r.end <= 0.2 + 1e-9 for r in run.results)


def test_shared_reads_are_those_of_shared_blocks():
    prefix = list(range(100, 164))  # four blocks
    reqs = [SimRequest(prefix + [i + 3] * 8, 12, at=0.02 * i) for i in range(4)]
    config = SchedulerConfig(num_blocks=128)
    # behind a decode worker each imported prompt has blocks of its own: nothing is shared there
    split = Simulation(config, RecordingCosts(), decoders=1)
    split.run(reqs)
    assert split.costs.shapes and max(s.shared_context for s in split.costs.shapes) == 0
    # on one engine the later requests hit the first one's prefix: their decode rows read its blocks
    shared = Simulation(config, RecordingCosts())
    shared.run(reqs)
    assert max(s.decodes for s in shared.costs.shapes) == 4
    assert max(s.shared_context for s in shared.costs.shapes) == 3 * 64


class RecordingCosts:
    """10 ms a step; keeps every shape it was asked about."""

    def __init__(self) -> None:
        self.shapes: list[StepShape] = []

    def seconds(self, shape: StepShape) -> float:
        self.shapes.append(shape)
        return 0.01

    def describe(self) -> str:
        return "recording"
