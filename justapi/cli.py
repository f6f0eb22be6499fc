"""The ``justapi`` command: ``serve`` (the OpenAI-compatible server), ``generate`` (one prompt, streamed), ``pull``
(a model from a Hugging Face hub, justapi.hub) and ``bench`` (benchmarks, in justapi.bench.cli)."""

from __future__ import annotations

import contextlib
import signal
import sys

from .startup import (CliError, build_parser, check_model_file, engine_config, models_app, resolve_hub_models,
                      serve_app, several_models, tp_sizes, uvicorn_stack)


def cmd_serve(args) -> int:
    import uvicorn

    if several_models(args):
        app, server_cfg = models_app(args)
    else:
        cfg = engine_config(args)
        if cfg.distributed_executor == "ray" and cfg.data_parallel is not None:  # replicas as Ray Serve deployments
            from .ray_serve import run

            return run(args)
        app, server_cfg = serve_app(args)
    server = _uvicorn_server_class()(uvicorn.Config(app, host=server_cfg.host, port=server_cfg.port, access_log=False,
                                                    log_level=server_cfg.log_level.lower(),
                                                    timeout_graceful_shutdown=5, **uvicorn_stack()))
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
    if cfg.worker_processes:
        raise CliError("--disaggregate and --data-parallel are for justapi serve")
    check_model_file(cfg.model, cfg.draft_model, tp_sizes(cfg))
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k)
    except ValueError as e:
        raise CliError(str(e)) from None
    engine = EngineCore(cfg)
    if args.chat:
        ids = engine.render_chat([{"role": "user", "content": args.prompt}], True)
    else:
        ids = engine.tokenizer.encode(args.prompt)
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


def cmd_pull(args) -> int:
    from .hub import pull

    print(pull(args.ref))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .hub import HubError
    from .model.chat_template import ChatTemplateError
    from .model.gguf_loader import ModelLoadError

    try:
        if args.command == "pull":
            return cmd_pull(args)
        resolve_hub_models(args)
        if args.command == "bench":
            from .bench.cli import main as bench_main

            return bench_main(args, engine_config)
        if args.command == "plan":
            from .plan.cli import main as plan_main

            return plan_main(args, engine_config, build_parser)
        return {"serve": cmd_serve, "generate": cmd_generate}[args.command](args)
    except (CliError, ModelLoadError, ChatTemplateError, HubError) as e:
        print(f"justapi: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
