"""What crosses the network per request when JustAPI spans hosts (docs/scaling.md), counted from the model's shape
and measured here on loopback, and the bandwidth that makes at a target load.

- Disaggregation: a prompt's KV goes prefill worker → decode worker, whole blocks: layers x 2 (K, V) x KV heads x
  head dim x bytes per element (the KV cache's dtype) per prompt token. Measured: PdEngine's transfer counters.
- Tensor parallelism: per computed row, two all-reduces a layer and one for the embedding of the hidden vector in
  fp32, and per sampled row the logits' all-gather (every rank's vocabulary slice, fp32). A ring all-reduce moves
  2 (N-1)/N of the payload in and out of each rank. Measured: TpComm's byte counter (rank 0's payload).
- Data-parallel replicas: the request and its streamed tokens only, nothing between replicas.

    .venv/bin/python benchmarks/network_bytes.py [--model PATH] [--prompt-len 256] [--requests 4]
"""

from __future__ import annotations

import argparse
import random

from justapi import LLM, SamplingParams
from justapi.config import EngineConfig
from justapi.model.gguf_loader import default_model_path, open_gguf, read_model_config


def shape_figures(cfg, kv_bytes_per_element: int, tp: int) -> dict:
    per_token_kv = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * kv_bytes_per_element
    all_reduce = (2 * cfg.num_layers + 1) * cfg.hidden_size * 4  # payload per computed row
    ring = 2 * (tp - 1) / tp  # share of an all-reduce's payload each rank sends (and receives)
    gather = cfg.vocab_size * 4 * (tp - 1) / tp  # logits each rank receives per sampled row
    return {"kv_per_prompt_token": per_token_kv, "tp_payload_per_row": all_reduce,
            "tp_wire_per_row": all_reduce * ring, "tp_logits_per_sampled_row": gather}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=default_model_path())
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=16)
    args = ap.parse_args()
    cfg = read_model_config(open_gguf(args.model), args.model)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 20000) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)

    from justapi.engine.pd_engine import PdEngine

    pd = PdEngine(EngineConfig(args.model, disaggregate=True, num_threads=1, show_progress=False))
    try:
        kv_bytes_per_element = 2 if pd.config.kv_cache_dtype in ("auto", "bfloat16") else 4
        for i, p in enumerate(prompts):
            pd.add_request(f"r{i}", p, params)
        while pd.has_unfinished:
            pd.step()
        import time

        time.sleep(0.5)
        pd.step()
        st = pd.pd.stats
        blocks = sum(-(-len(p) // pd.config.block_size) for p in prompts)
        measured_kv = st.kv_bytes / (blocks * pd.config.block_size)
    finally:
        pd.close()
    shape = shape_figures(cfg, kv_bytes_per_element, 2)
    print(f"model {args.model}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_kv_heads} KV heads x "
          f"{cfg.head_dim}, vocabulary {cfg.vocab_size}")
    print(f"disaggregation: KV per prompt token {shape['kv_per_prompt_token'] / 1024:.1f} KiB from the shape, "
          f"{measured_kv / 1024:.1f} KiB measured ({st.kv_transfers} transfers, {st.kv_bytes / 2**20:.2f} MiB, "
          f"{st.kv_seconds / max(st.kv_transfers, 1) * 1000:.1f} ms each on loopback)")

    llm = LLM(args.model, tp=2, num_threads=1, show_progress=False)
    comm = llm.engine.executor.comm
    out = llm.generate(prompts, params)
    rows = sum(len(p) for p in prompts) + sum(len(o.token_ids) - 1 for o in out)  # rows computed
    sampled = sum(len(o.token_ids) for o in out)
    llm.engine.close()
    payload = shape["tp_payload_per_row"] * rows + cfg.vocab_size * 4 * sampled  # rank 0's collectives' payload
    print(f"tensor parallelism (tp 2): all-reduce payload per computed row {shape['tp_payload_per_row'] / 1024:.1f} KiB "
          f"({shape['tp_wire_per_row'] / 1024:.1f} KiB on the wire per rank), logits gathered per sampled row "
          f"{shape['tp_logits_per_sampled_row'] / 1024:.1f} KiB; this run {rows} rows, {sampled} sampled: "
          f"{payload / 2**20:.1f} MiB from the shape, {comm.bytes / 2**20:.1f} MiB measured "
          f"({comm.seconds:.2f} s in {comm.calls} collectives)")
    for prefill, decode in ((1000, 100), (10000, 1000)):
        kv = shape["kv_per_prompt_token"] * prefill
        tp_bw = shape["tp_wire_per_row"] * (prefill + decode) + shape["tp_logits_per_sampled_row"] * decode
        print(f"at {prefill} prompt tok/s and {decode} output tok/s: disaggregation {kv * 8 / 1e9:.2f} Gbit/s "
              f"prefill -> decode; tp 2 across two hosts {tp_bw * 8 / 1e9:.2f} Gbit/s each way")


if __name__ == "__main__":
    main()
