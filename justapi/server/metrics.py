"""Prometheus metrics: request latencies, token counters, and the scheduler / prefix-cache state of the engine's
latest snapshot."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..core.kv_store import KvStoreStats, merged
from ..core.stats import PdSnapshot, SchedulerSnapshot
from ..engine.async_llm import RequestTiming
from ..engine.output_processor import RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 20.0,
                    40.0, 80.0)
_ERROR_BUCKETS = (-20.0, -10.0, -5.0, -2.5, -1.0, -0.5, -0.25, -0.1, 0.0, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0)
MAX_CLASS_LABELS = 64  # distinct users (or priorities) with labels of their own; the rest share "other"
MAX_LABEL_CHARS = 64  # a label value's length: a name's first characters (every scrape repeats it per series)
# a request id's prefix (server.serving.new_id) -> the API family it came through
API_FAMILIES = {"chatcmpl": "openai", "cmpl": "openai", "embd": "openai", "msg": "anthropic", "ollama": "ollama",
                "score": "scoring", "resp": "responses", "offline": "offline"}


def api_family(request_id: str) -> str:
    return API_FAMILIES.get(request_id.split("-", 1)[0], "other")


class ClassLabels:
    """Label values for client-chosen names (users, priorities), bounded: a client must not grow /metrics without
    end. The first MAX_CLASS_LABELS names seen keep their own (their first MAX_LABEL_CHARS characters); later ones
    are "other"."""

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def __call__(self, name) -> str:
        text = "anonymous" if name is None else str(name)[:MAX_LABEL_CHARS]
        if text in self._seen:
            return text
        if len(self._seen) < MAX_CLASS_LABELS:
            self._seen.add(text)
            return text
        return "other"


class _SnapshotCollector:
    """Renders the engine's latest stats snapshot (taken on the engine thread: core.stats), a SchedulerSnapshot or,
    disaggregated, a PdSnapshot. The prefix-cache names are the documented contract, kept exact."""

    def __init__(self, latest, users: ClassLabels, priorities: ClassLabels) -> None:
        self.latest = latest  # () -> SchedulerSnapshot | PdSnapshot | None
        self.users, self.priorities = users, priorities

    def collect(self):
        snap = self.latest()
        if isinstance(snap, SchedulerSnapshot):
            yield from _scheduler_metrics(snap)
            yield from self._queue_by_class(snap)
        elif isinstance(snap, PdSnapshot):
            yield from _pd_metrics(snap)


    def _queue_by_class(self, snap: SchedulerSnapshot):
        for name, label, key, rows in (
            ("justapi_requests_waiting_by_priority", "priority", self.priorities, snap.waiting_by_priority),
            ("justapi_requests_waiting_by_user", "user", self.users, snap.waiting_by_user),
        ):
            g = GaugeMetricFamily(name, f"Requests queued or preempted, per {label}", labels=[label])
            counts: dict[str, int] = {}
            for value, n in rows:
                counts[key(value)] = counts.get(key(value), 0) + n
            for value, n in counts.items():
                g.add_metric([value], n)
            yield g


def _prefix_cache_metrics(hits: int, misses: int, blocks: int, where: str):
    # plain gauges so the exposed names are exactly these (a Prometheus counter would gain "_total")
    yield GaugeMetricFamily("prefix_cache_hits", f"Prompt KV blocks found in {where} (memory or disk)", value=hits)
    yield GaugeMetricFamily("prefix_cache_misses", "Prompt KV blocks looked up and not found", value=misses)
    yield GaugeMetricFamily("prefix_cache_hit_ratio", "hits / (hits + misses)",
                            value=hits / (hits + misses) if hits + misses else 0.0)
    yield GaugeMetricFamily("prefix_cache_blocks", f"KV blocks currently held by {where}", value=blocks)


def _disk_tier_metrics(hits: int, disk_hits: int, disk: KvStoreStats | None):
    """The prefix cache's hits by tier and, with --prefix-cache-dir, what its disk tier read, wrote and refused."""
    tiers = GaugeMetricFamily("justapi_prefix_cache_hits_by_tier", "Prompt KV blocks a first lookup found, by where "
                              "(memory: the radix tree; disk: --prefix-cache-dir)", labels=["tier"])
    tiers.add_metric(["memory"], hits - disk_hits)
    tiers.add_metric(["disk"], disk_hits)
    yield tiers
    if disk is None:
        return
    for name, help, value in (
        ("loaded_blocks", "KV blocks read from disk into sequences", disk.loaded_blocks),
        ("read_bytes", "Bytes of KV blocks read from disk", disk.read_bytes),
        ("read_seconds", "Seconds spent reading KV blocks from disk", disk.read_seconds),
        ("written_blocks", "KV blocks written to disk", disk.written_blocks),
        ("written_bytes", "Bytes written to disk, headers included", disk.written_bytes),
        ("saved_seconds", "Prefill seconds the loaded blocks saved (measured cost per prompt token, less the reads)",
         disk.saved_seconds),
        ("write_errors", "Blocks whose write failed (a full disk, ...); they stay in memory only", disk.write_errors),
        ("dropped_blocks", "Blocks not written because the writer was too far behind", disk.dropped),
        ("evicted_files", "Files removed to keep the directory under --prefix-cache-dir-size", disk.evicted_files),
    ):
        yield CounterMetricFamily(f"justapi_prefix_cache_disk_{name}", help, value=value)
    rejected = CounterMetricFamily("justapi_prefix_cache_disk_rejected", "Files refused on read and removed, by why "
                                   "(corrupt, truncated, foreign: another model or layout, unreadable)",
                                   labels=["reason"])
    for reason in ("corrupt", "truncated", "foreign", "unreadable"):
        rejected.add_metric([reason], disk.rejected.get(reason, 0))
    yield rejected
    yield GaugeMetricFamily("justapi_prefix_cache_disk_bytes", "Bytes in --prefix-cache-dir (every model's files)",
                            value=disk.disk_bytes)
    yield GaugeMetricFamily("justapi_prefix_cache_disk_max_bytes", "--prefix-cache-dir-size", value=disk.max_bytes)


def _scheduler_metrics(snap: SchedulerSnapshot):
    yield from _prefix_cache_metrics(snap.prefix_cache_hits, snap.prefix_cache_misses, snap.prefix_cache_blocks,
                                     "the prefix cache")
    yield from _disk_tier_metrics(snap.prefix_cache_hits, snap.prefix_cache_disk_hits, snap.disk_tier)
    yield GaugeMetricFamily("justapi_requests_running", "Requests being computed", value=snap.num_running)
    yield GaugeMetricFamily("justapi_requests_waiting", "Requests queued or preempted", value=snap.num_waiting)
    yield GaugeMetricFamily("justapi_kv_blocks_used", "KV blocks in use (requests and cache)",
                            value=snap.kv_blocks_used)
    yield GaugeMetricFamily("justapi_kv_blocks_total", "KV blocks in the pool", value=snap.kv_blocks_total)
    yield GaugeMetricFamily("justapi_kv_blocks_used_by_requests", "KV blocks owned by running requests",
                            value=snap.kv_blocks_used_by_requests)
    if snap.state_slots_total:  # a hybrid model's state cache
        yield GaugeMetricFamily("justapi_state_slots_total", "State cache slots (one per sequence run at once)",
                                value=snap.state_slots_total)
        yield GaugeMetricFamily("justapi_state_slots_used", "State cache slots held by running requests",
                                value=snap.state_slots_used)
        yield GaugeMetricFamily("justapi_state_cache_bytes", "Bytes of the recurrent layers' state cache",
                                value=snap.state_cache_bytes)
    st = snap.counters
    yield CounterMetricFamily("justapi_preemptions", "Requests preempted for lack of KV blocks",
                              value=st.num_preemptions)
    yield CounterMetricFamily("justapi_engine_steps", "Engine iterations", value=st.num_steps)
    yield GaugeMetricFamily("justapi_step_tokens", "Tokens computed in the last step", value=st.last_step_tokens)
    yield CounterMetricFamily("justapi_scheduled_tokens", "Tokens computed over all steps",
                              value=st.num_scheduled_tokens_total)
    yield CounterMetricFamily("justapi_spec_draft_tokens", "Draft tokens verified by the target",
                              value=st.spec_draft_tokens)
    yield CounterMetricFamily("justapi_spec_accepted_tokens", "Draft tokens accepted", value=st.spec_accepted_tokens)
    yield GaugeMetricFamily("justapi_spec_acceptance_rate", "Accepted / verified draft tokens",
                            value=st.spec_acceptance_rate)
    yield GaugeMetricFamily("justapi_spec_mean_accepted_length",
                            "Tokens emitted per speculative step (accepted drafts + the target's token)",
                            value=st.spec_mean_accepted_length)
    per_pos = GaugeMetricFamily("justapi_spec_acceptance_rate_by_position",
                                "Acceptance rate of the k-th draft token (0 = first), when it was verified",
                                labels=["position"])
    for k, (acc, prop) in enumerate(zip(st.spec_accepted_at, st.spec_proposed_at)):
        per_pos.add_metric([str(k)], acc / prop if prop else 0.0)
    yield per_pos
    if st.batch_utilizations:
        yield GaugeMetricFamily("justapi_static_batch_utilization", "U of the last static batch",
                                value=st.batch_utilizations[-1])


def _pd_metrics(snap: PdSnapshot):
    """Engines in worker processes: each pool's and each worker's last reports, and the KV transfers."""
    entry = [w for w in snap.workers if w.role == snap.entry_role]
    # the prefix cache that matters is where prompts are computed: the prefill workers', or the replicas'
    yield from _prefix_cache_metrics(sum(w.cache_hits for w in entry), sum(w.cache_misses for w in entry),
                                     sum(w.cached_blocks for w in entry),
                                     f"the {snap.entry_role} workers' prefix caches")
    disks = [w.disk for w in entry if w.disk is not None]
    yield from _disk_tier_metrics(sum(w.cache_hits for w in entry), sum(w.disk_hits for w in entry),
                                  merged(disks) if disks else None)
    st = snap.counters
    if snap.entry_role == "prefill":
        yield CounterMetricFamily("justapi_pd_kv_transfers", "Requests whose KV moved to a decode worker",
                                  value=st.kv_transfers)
        yield CounterMetricFamily("justapi_pd_kv_transfer_bytes", "KV bytes moved prefill → decode", value=st.kv_bytes)
        yield CounterMetricFamily("justapi_pd_kv_transfer_blocks", "KV blocks moved prefill → decode",
                                  value=st.kv_blocks)
        yield CounterMetricFamily("justapi_pd_kv_transfer_seconds", "Time from posting a KV send to its completion",
                                  value=st.kv_seconds)
    yield CounterMetricFamily("justapi_pd_requests_retried", f"Requests sent to another {snap.entry_role} worker "
                              "after a worker died (nothing streamed yet)", value=st.retried)
    yield CounterMetricFamily("justapi_pd_requests_failed", "Requests failed because a worker died", value=st.failed)
    roles = list(dict.fromkeys(w.role for w in snap.workers))
    for name, help_text, attr in (
        ("justapi_pd_queue_length", "Requests waiting in a pool (sum of its workers' queues)", "waiting"),
        ("justapi_pd_running", "Requests being computed in a pool", "running"),
    ):
        g = GaugeMetricFamily(name, help_text, labels=["pool"])
        for role in roles:
            g.add_metric([role], sum(getattr(w, attr) for w in snap.pool(role)))
        yield g
    util = GaugeMetricFamily("justapi_pd_utilization", "Share of wall time a pool's live workers spent in engine "
                             "steps (mean over the workers, last report)", labels=["pool"])
    alive = GaugeMetricFamily("justapi_pd_workers_alive", "Live workers per pool", labels=["pool"])
    for role in roles:
        live = snap.pool(role)
        util.add_metric([role], sum(w.busy_fraction for w in live) / len(live) if live else 0.0)
        alive.add_metric([role], len(live))
    yield util
    yield alive
    yield from _per_worker_metrics(snap)


def _per_worker_metrics(snap: PdSnapshot):
    """The same figures worker by worker (label ``worker``: its rank; ``role``: its pool), as last reported."""
    families = [
        (GaugeMetricFamily, "justapi_worker_alive", "1 while the worker process lives", lambda w: float(w.alive)),
        (GaugeMetricFamily, "justapi_worker_requests_running", "Requests being computed", lambda w: w.running),
        (GaugeMetricFamily, "justapi_worker_requests_waiting", "Requests queued or preempted", lambda w: w.waiting),
        (GaugeMetricFamily, "justapi_worker_utilization", "Share of wall time in engine steps",
         lambda w: w.busy_fraction),
        (GaugeMetricFamily, "justapi_worker_prefix_cache_hits", "Prompt KV blocks found in its prefix cache",
         lambda w: w.cache_hits),
        (GaugeMetricFamily, "justapi_worker_prefix_cache_misses", "Prompt KV blocks looked up and not found",
         lambda w: w.cache_misses),
        (GaugeMetricFamily, "justapi_worker_prefix_cache_blocks", "KV blocks held by its prefix cache",
         lambda w: w.cached_blocks),
        (CounterMetricFamily, "justapi_worker_requests_routed", "Requests the router sent to it (retries included)",
         lambda w: w.routed),
    ]
    for kind, name, help_text, value in families:
        family = kind(name, help_text, labels=["worker", "role"])
        for w in snap.workers:
            family.add_metric([str(w.rank), w.role], value(w))
        yield family


class Metrics:
    """All metrics of one server, in their own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("justapi_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("justapi_time_per_output_token_seconds", "Time per output token after the first",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("justapi_e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("justapi_prompt_tokens", "Prompt tokens processed", registry=r)
        self.cached_prompt_tokens = Counter("justapi_cached_prompt_tokens",
                                            "Prompt tokens served from the prefix cache", registry=r)
        self.generation_tokens = Counter("justapi_generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter("justapi_requests_finished", "Requests finished", ["finish_reason"], registry=r)
        self.by_api = Counter("justapi_requests_by_api", "Requests finished, per API family (openai, responses, "
                              "anthropic, ollama, scoring)", ["api"], registry=r)
        # scheduling (core.policy, --request-timeout, --ttft-slo)
        self.users, self.priorities = ClassLabels(), ClassLabels()
        self.timeouts = Counter("justapi_request_timeouts", "Requests ended by their deadline", registry=r)
        self.slo_refusals = Counter("justapi_slo_refusals", "Requests refused (429) because their predicted time to "
                                    "first token exceeded --ttft-slo", registry=r)
        self.ttft_error = Histogram("justapi_ttft_prediction_error_seconds", "Measured minus predicted time to first "
                                    "token, per admitted request with a prediction", buckets=_ERROR_BUCKETS, registry=r)
        self.ttft_by_priority = Histogram("justapi_time_to_first_token_by_priority_seconds", "Time to first token, "
                                          "per priority", ["priority"], buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft_by_user = Histogram("justapi_time_to_first_token_by_user_seconds", "Time to first token, per user",
                                      ["user"], buckets=_LATENCY_BUCKETS, registry=r)
        self.tokens_by_priority = Counter("justapi_tokens_served_by_priority", "Prompt + generated tokens of "
                                          "finished requests, per priority", ["priority"], registry=r)
        self.tokens_by_user = Counter("justapi_tokens_served_by_user", "Prompt + generated tokens of finished "
                                      "requests, per user", ["user"], registry=r)

    def attach(self, latest_stats) -> None:
        """Export the engine's state from ``latest_stats()``, its newest snapshot (AsyncLLM.stats)."""
        self.registry.register(_SnapshotCollector(latest_stats, self.users, self.priorities))

    def observe(self, out: RequestOutput, timing: RequestTiming, request_id: str = "") -> None:
        """Record one finished request (called from the engine thread)."""
        self.finished.labels(out.finish_reason or "unknown").inc()
        self.by_api.labels(api_family(request_id)).inc()
        self.prompt_tokens.inc(out.num_prompt_tokens)
        self.cached_prompt_tokens.inc(out.num_cached_tokens)
        self.generation_tokens.inc(len(out.token_ids))
        if out.stop_reason == "timeout":
            self.timeouts.inc()
        priority, user = self.priorities(timing.priority), self.users(timing.user)
        served = out.num_prompt_tokens + len(out.token_ids)
        self.tokens_by_priority.labels(priority).inc(served)
        self.tokens_by_user.labels(user).inc(served)
        if timing.finished is not None:
            self.e2e.observe(timing.finished - timing.arrival)
        if timing.first_token is not None:
            ttft = timing.first_token - timing.arrival
            self.ttft.observe(ttft)
            self.ttft_by_priority.labels(priority).observe(ttft)
            self.ttft_by_user.labels(user).observe(ttft)
            if timing.predicted_ttft is not None:
                self.ttft_error.observe(ttft - timing.predicted_ttft)
            if timing.finished is not None and timing.num_output_tokens > 1:
                self.tpot.observe((timing.finished - timing.first_token) / (timing.num_output_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
