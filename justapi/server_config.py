"""The HTTP server's settings (``justapi serve``'s server flags): a frozen dataclass, user errors as ValueError."""

from __future__ import annotations

from dataclasses import dataclass

from .config import flag
from .sizes import parse_size

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_MAX_QUEUE = 1024
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_N = 16
DEFAULT_MAX_PROMPTS = 2048  # prompts in one completions request, inputs in one embeddings request (OpenAI's limit)
DEFAULT_MAX_CHOICES = 2048  # sequences one request may start (prompts x n): each is a request to the scheduler
DEFAULT_SERVED_MODEL_NAME = None  # None: the model file's stem
DEFAULT_IDLE_UNLOAD_S = 300.0  # Ollama's default keep_alive
DEFAULT_MODELS_MEMORY_FRACTION = 0.8  # of the memory available at start, the several models' default budget


@dataclass(frozen=True)
class ServerConfig:
    """HTTP server settings (``justapi serve``)."""

    host: str = flag(DEFAULT_HOST, "address to bind")
    port: int = flag(DEFAULT_PORT, "port to bind")
    api_key: str | None = flag(None, "require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every route but "
                               "/health; several keys comma-"
                               "separated, each then a user of its own under --scheduling-policy fair (key-1, "
                               "key-2, ... in this order)", metavar="KEY[,KEY]")
    served_model_name: str | None = flag(DEFAULT_SERVED_MODEL_NAME, "model name clients use (default: the file name)",
                                         metavar="NAME")
    max_queue: int = flag(DEFAULT_MAX_QUEUE, "requests waiting before the server answers 429")
    max_body_bytes: int = flag(DEFAULT_MAX_BODY_BYTES, "largest request body; larger ones get 413")
    max_n: int = flag(DEFAULT_MAX_N, "largest n (completions per request)")
    max_prompts: int = flag(DEFAULT_MAX_PROMPTS, "most prompts in one completions request (and inputs in one "
                            "embeddings request)")
    max_choices: int = flag(DEFAULT_MAX_CHOICES, "most sequences one request may start (prompts x n)")
    clamp_max_tokens: bool = flag(False, "cut a max_tokens beyond what fits (the context, the KV pool) to what "
                                  "fits, as llama.cpp and Ollama do, instead of answering 400 (as vLLM)")
    open_metrics: bool = flag(False, "serve /metrics without a key when --api-key is set")
    strict_fields: bool = flag(False, "refuse (400) request fields the server does not know, instead of ignoring "
                               "them with a warning naming them (as vLLM, llama.cpp and Ollama ignore them)")
    allowed_origins: str | None = flag(None, "browser origins allowed to call the server (CORS), comma-separated, "
                                       "or '*'; none by default", metavar="ORIGIN[,ORIGIN]")
    log_level: str = flag("info", "log level", choices=("critical", "error", "warning", "info", "debug"))
    stats_interval_s: float = flag(10.0, "seconds between the scheduler's stats lines in the log")
    request_timeout: float | None = flag(None, "seconds after which a request ends with what it has generated "
                                         "(finish_reason length, stop_reason timeout); a request's own timeout "
                                         "field may ask for less", metavar="SECONDS")
    ttft_slo: float | None = flag(None, "refuse at once (429 with Retry-After) a request whose predicted time to "
                                  "first token exceeds this many seconds", metavar="SECONDS")
    dashboard: bool = flag(True, "the live dashboard at /dashboard (the schedule, KV pool and prefix cache; behind "
                           "--api-key)")
    dashboard_prompt_text: bool = flag(False, "show the first words of the most shared prompt prefixes on the "
                                       "dashboard (clients' prompt text, to anyone with a key)")
    models_dir: str | None = flag(None, "serve every .gguf file in DIR, each named by its file (aliases and flags "
                                  "of its own from DIR/models.toml), loaded on its first request", metavar="DIR")
    idle_unload: float = flag(DEFAULT_IDLE_UNLOAD_S, "with several models (--model repeated, --models-dir): seconds "
                              "a model stays loaded after its last request (a request's keep_alive may say "
                              "otherwise)", metavar="SECONDS")
    max_loaded_models: int | None = flag(None, "with several models: most models loaded at once (the least recently "
                                         "used idle one unloads first)", metavar="N")
    models_memory: str | None = flag(None, "with several models: bytes the loaded models may take together (files, "
                                     "processes, KV pools), e.g. 8G; default: four fifths of available memory",
                                     metavar="SIZE")

    @property
    def api_keys(self) -> tuple[str, ...]:
        return tuple(self.api_key.split(",")) if self.api_key is not None else ()

    @property
    def origins(self) -> tuple[str, ...]:
        return tuple(o.strip() for o in self.allowed_origins.split(",")) if self.allowed_origins else ()

    def models_memory_bytes(self) -> int | None:
        """--models-memory in bytes (None: the default budget); ValueError where it does not parse."""
        return None if self.models_memory is None else parse_size(self.models_memory, "--models-memory")

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be in 1..65535, not {self.port}")
        for name in ("max_queue", "max_n", "max_prompts", "max_choices", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, not {getattr(self, name)}")
        if self.api_key is not None and not all(self.api_keys):
            raise ValueError("--api-key: a key is empty")
        for name in ("request_timeout", "ttft_slo"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive number of seconds, not {value!r}")
        if not self.idle_unload >= 0:
            raise ValueError(f"--idle-unload must be a number of seconds >= 0, not {self.idle_unload!r}")
        if self.max_loaded_models is not None and self.max_loaded_models < 1:
            raise ValueError(f"--max-loaded-models must be a positive integer, not {self.max_loaded_models}")
        self.models_memory_bytes()  # raises on a size that does not parse
        if self.log_level.lower() not in ("critical", "error", "warning", "info", "debug"):
            raise ValueError("--log-level must be one of critical, error, warning, info, debug, "
                             f"not {self.log_level!r}")
