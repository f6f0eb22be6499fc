"""The prefix cache's disk tier (--prefix-cache-dir, core.kv_store): greedy output identical with it on and off,
after eviction and after a restart; files checked on read (corrupt, truncated, another model's), the size bound, a
full disk, a server killed while writing."""

from __future__ import annotations

import os
import random
import signal
import subprocess

import httpx
import pytest

from justapi import LLM, SamplingParams
from justapi.core.kv_store import PROBE_EVERY, KvStore, chain_keys
from server_helpers import ServerProcess, labelled, metric, wait_until

OPTS = dict(pool_blocks=40, block_size=4, show_progress=False, batch_invariant=True)
DISK = dict(prefix_cache_dir_reads="always")  # the tiny model computes a block about as fast as it reads one
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
FP_A, FP_B = "a" * 32, "b" * 32


def tree_prompts(vocab: int, n: int, seed: int = 5) -> list[list[int]]:
    """``n`` prompts sharing prefixes along a random tree (as a chat app's system prompts and turns do)."""
    rng = random.Random(seed)
    nodes: list[list[int]] = [[]]
    for _ in range(60):
        nodes.append(rng.choice(nodes) + [rng.randrange(3, vocab) for _ in range(rng.randint(2, 12))])
    return [rng.choice(nodes[1:]) + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 5))] for _ in range(n)]


def read(store: KvStore, key: str, toks: list[int]) -> bytes | None:
    """The payload ``store`` reads for ``key``, or None where it refuses."""
    buf = bytearray(store.block_bytes)
    return bytes(buf) if store.read(key, toks, memoryview(buf)) else None


def tokens(results) -> list[list[int]]:
    return [r.token_ids for r in results]


@pytest.fixture(scope="module")
def reference(tiny_model):
    """The prompts and their greedy outputs without any prefix cache."""
    off = LLM(tiny_model, prefix_cache=False, **OPTS)
    prompts = tree_prompts(off.engine.model_config.vocab_size, 160)
    return prompts, tokens(off.generate(prompts, GREEDY))


def test_greedy_output_identical_with_the_disk_tier_under_eviction_and_after_a_restart(tiny_model, reference,
                                                                                       tmp_path):
    prompts, want = reference
    disk = str(tmp_path / "kv")
    first = LLM(tiny_model, prefix_cache_dir=disk, **DISK, **OPTS)  # 40 blocks: the tree's prefixes are evicted
    assert tokens(first.generate(prompts, GREEDY)) == want
    kv = first.engine.scheduler.kv
    assert kv.disk_hits > 0 and first.engine.store.snapshot().written_blocks > 0
    kv.check_integrity(first.engine.scheduler.running, first.engine.scheduler.waiting)
    first.engine.close()  # writes what is queued
    restarted = LLM(tiny_model, prefix_cache_dir=disk, **DISK, **OPTS)
    assert tokens(restarted.generate(prompts, GREEDY)) == want
    stats = restarted.engine.store.snapshot()
    assert stats.loaded_blocks > 0 and stats.rejected == {} and stats.write_errors == 0
    # every prompt's first lookup: what the memory had not, the disk had (the first engine wrote every block)
    sched = restarted.engine.scheduler
    assert sched.kv.disk_hits > 0.5 * sched.cache.hits
    sched.check_integrity()
    assert sched.pool.num_free + sched.num_cached_blocks == sched.pool.num_blocks
    restarted.engine.close()


def test_files_that_fail_their_checks_are_skipped_counted_and_removed(tiny_model, reference, tmp_path):
    prompts, want = reference
    disk = str(tmp_path / "kv")
    writer = LLM(tiny_model, prefix_cache_dir=disk, **DISK, **OPTS)
    writer.generate(prompts[:40], GREEDY)
    writer.engine.close()
    files = sorted(os.path.join(d, f) for d, _, names in os.walk(disk) for f in names if f.endswith(".kv"))
    assert len(files) > 30
    damaged: dict[str, bytes] = {}
    for i, path in enumerate(files[::3]):  # a flipped payload byte, a cut file, a garbled header, in turn
        data = bytearray(open(path, "rb").read())
        if i % 3 == 0:
            data[-5] ^= 0x40
        elif i % 3 == 1:
            data = data[: len(data) - 7]
        else:
            data[:4] = b"JUNK"
        damaged[path] = bytes(data)
        open(path, "wb").write(damaged[path])
    reader = LLM(tiny_model, prefix_cache_dir=disk, **DISK, **OPTS)
    assert tokens(reader.generate(prompts[:40], GREEDY)) == want[:40]  # never loaded into a sequence
    rejected = reader.engine.store.snapshot().rejected
    assert rejected.get("corrupt", 0) > 0 and rejected.get("truncated", 0) > 0
    # each damaged file a lookup reached was removed (and its block written again once recomputed)
    reached = [p for p, data in damaged.items() if not os.path.exists(p) or open(p, "rb").read() != data]
    assert sum(rejected.values()) == len(reached) > 0
    reader.engine.close()


def test_another_models_file_at_this_models_key_is_refused(tmp_path):
    a = KvStore(str(tmp_path), 1 << 30, FP_A, 64)
    b = KvStore(str(tmp_path), 1 << 30, FP_B, 64)
    toks = [5, 6, 7, 8]
    key_a, key_b = chain_keys(FP_A, toks, 4, 1)[0], chain_keys(FP_B, toks, 4, 1)[0]
    assert key_a != key_b  # the same tokens under another model are another key
    b.write(key_b, toks, bytes(range(64)))
    assert b.flush(10)
    assert read(b, key_b, toks) == bytes(range(64))
    os.makedirs(os.path.dirname(a.path(key_a)), exist_ok=True)
    os.link(b.path(key_b), a.path(key_a))  # B's block where A looks
    assert read(a, key_a, toks) is None
    assert a.snapshot().rejected == {"foreign": 1} and not os.path.exists(a.path(key_a))
    a.write(key_a, toks, bytes(64))  # another layout's block size: refused too
    assert a.flush(10)
    wrong_size = KvStore(str(tmp_path), 1 << 30, FP_A, 128)
    assert read(wrong_size, key_a, toks) is None and wrong_size.snapshot().rejected == {"foreign": 1}
    assert not os.path.exists(a.path(key_a))
    a._known.discard(key_a)  # (the store remembers having written it; the file is gone)
    a.write(key_a, toks, bytes(64))
    assert a.flush(10) and os.path.exists(a.path(key_a))
    assert read(a, key_a, [5, 6, 7, 9]) is None  # the file of a key whose tokens differ (a collision): refused
    assert a.snapshot().rejected == {"foreign": 2}
    for store in (a, b, wrong_size):
        store.close()


def test_reads_are_made_where_they_measure_faster_than_the_prefill_they_save(tmp_path):
    store = KvStore(str(tmp_path), 1 << 30, FP_A, 1 << 16)
    key, toks = chain_keys(FP_A, [1, 2, 3, 4], 4, 1)[0], [1, 2, 3, 4]
    store.write(key, toks, bytes(1 << 16))
    assert store.flush(10)
    assert store.worth_reading(4)  # nothing measured yet
    assert read(store, key, toks) is not None  # a read measured: tens of microseconds
    store.note_prefill(1e-9, 1000)  # a model that computes a token in a picosecond
    decisions = [store.worth_reading(4) for _ in range(2 * PROBE_EVERY)]
    assert decisions.count(True) == 2  # only the probes that measure reads again
    for _ in range(40):
        store.note_prefill(10.0, 1000)  # now 10 ms a token
    assert all(store.worth_reading(4) for _ in range(10))
    store.close()


def test_the_size_bound_removes_the_least_recently_used_files(tmp_path):
    block = 4096
    store = KvStore(str(tmp_path), 20 * block, FP_A, block)
    keys = [chain_keys(FP_A, [i, i, i, i], 4, 1)[0] for i in range(22)]
    for i, key in enumerate(keys[:10]):
        store.write(key, [i] * 4, bytes(block))
    assert store.flush(10)
    for i, key in enumerate(keys[:10]):  # written long ago, one a second apart (not the clock's granularity)
        os.utime(store.path(key), (1000 + i, 1000 + i))
    assert read(store, keys[0], [0] * 4) is not None
    for i, key in enumerate(keys[10:], 10):
        store.write(key, [i] * 4, bytes(block))
    assert store.flush(10)
    stats = store.snapshot()
    on_disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, names in os.walk(tmp_path) for f in names)
    assert on_disk <= 20 * block + 20 * 512 and stats.disk_bytes == on_disk and stats.evicted_files > 0
    # 22 blocks over a bound of 20: down to 90% of it, the oldest first; the one read is not among them
    assert os.path.exists(store.path(keys[0])) and not os.path.exists(store.path(keys[1]))
    assert os.path.exists(store.path(keys[9]))
    store.close()


def test_a_dead_writers_temporary_file_is_removed_at_start(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    store = KvStore(str(tmp_path), 1 << 30, FP_A, 64)
    key = chain_keys(FP_A, [1, 2, 3, 4], 4, 1)[0]
    stale = f"{store.path(key)}.{dead.pid}-1.tmp"
    live = f"{store.path(key)}.{os.getpid()}-1.tmp"
    os.makedirs(os.path.dirname(stale), exist_ok=True)
    for path in (stale, live):
        open(path, "wb").write(b"half a block")
    store.close()
    KvStore(str(tmp_path), 1 << 30, FP_A, 64).close()
    assert not os.path.exists(stale) and os.path.exists(live)  # a running writer's file stays


def test_tensor_parallel_ranks_write_and_read_every_head(tiny_model, reference, tmp_path):
    """Under --tp 2 the tiny model's two KV heads are split: the files hold both (rank 0 gathers them), a restart
    reads them back into each rank's own heads."""
    prompts, want = reference
    opts = dict(OPTS, tp=2, prefix_cache_dir=str(tmp_path / "kv"), **DISK)
    first = LLM(tiny_model, **opts)
    try:
        assert tokens(first.generate(prompts[:40], GREEDY)) == want[:40]
    finally:
        first.engine.close()
    assert first.engine.store.snapshot().written_blocks > 0 and first.engine.store.snapshot().write_errors == 0
    again = LLM(tiny_model, **opts)
    try:
        assert tokens(again.generate(prompts[:40], GREEDY)) == want[:40]
        assert again.engine.scheduler.kv.disk_hits > 0
    finally:
        again.engine.close()


def test_static_batching_and_a_pool_the_disk_run_would_fill(tiny_model, reference, tmp_path):
    """Static batching admits a whole batch and schedules part of it: a preempted or aborted request whose disk
    blocks never reached the runner does not cache them. A prompt whose prefix on disk would fill the pool still
    starts (its first chunk's blocks are left free) and gives the same output."""
    prompts, want = reference
    disk = str(tmp_path / "kv")
    static = LLM(tiny_model, static_batching=True, max_seqs=8, prefix_cache_dir=disk, **DISK, **OPTS)
    assert tokens(static.generate(prompts, GREEDY)) == want
    static.engine.scheduler.check_integrity()
    static.engine.close()
    again = LLM(tiny_model, static_batching=True, max_seqs=8, prefix_cache_dir=disk, **DISK, **OPTS)
    assert tokens(again.generate(prompts, GREEDY)) == want
    assert again.engine.scheduler.kv.disk_hits > 0
    again.engine.scheduler.check_integrity()
    again.engine.close()
    # a long prompt whose prefix is on disk, behind a request holding 16 of the pool's 40 blocks: the disk run is
    # cut to leave its first chunk room (else its reads were made, and wasted, at every step it waited)
    rng = random.Random(1)
    long, other = [rng.randrange(3, 250) for _ in range(130)], [rng.randrange(3, 250) for _ in range(58)]
    alone = [r.token_ids for r in LLM(tiny_model, prefix_cache=False, **OPTS).generate([other, long], GREEDY)]
    writer = LLM(tiny_model, prefix_cache_dir=disk, **DISK, **OPTS)
    assert writer.generate([long], GREEDY)[0].token_ids == alone[1]
    writer.engine.close()
    reader = LLM(tiny_model, prefix_cache_dir=disk, **DISK, **dict(OPTS, chunk_size=16))
    assert [r.token_ids for r in reader.generate([other, long], GREEDY)] == alone
    stats, kv = reader.engine.store.snapshot(), reader.engine.scheduler.kv
    assert kv.disk_hits > 0 and stats.read_bytes == stats.loaded_blocks * reader.engine.store.block_bytes
    kv.check_integrity(reader.engine.scheduler.running, reader.engine.scheduler.waiting)
    reader.engine.close()


def test_a_hybrid_model_is_refused_in_one_line(tmp_path):
    from tiny_hybrid import write_tiny_qwen35

    from justapi.model.gguf_loader import ModelLoadError

    path, _ = write_tiny_qwen35(str(tmp_path / "q35.gguf"))
    with pytest.raises(ModelLoadError, match="recurrent states are not written to disk"):
        LLM(path, prefix_cache_dir=str(tmp_path / "kv"), show_progress=False)


def _answer(url: str, prompt: list[int]) -> list[int]:
    r = httpx.post(url + "/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


def test_a_server_killed_while_writing_restarts_from_its_directory(tiny_model, tmp_path):
    disk = str(tmp_path / "kv")
    args = ["--model", tiny_model, "--pool-blocks", "64", "--block-size", "4", "--batch-invariant",
            "--prefix-cache-dir", disk, "--prefix-cache-dir-reads", "always"]
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 250) for _ in range(120)] for _ in range(6)]
    srv = ServerProcess(args, str(tmp_path / "first.log"))
    try:
        want = [_answer(srv.url, p) for p in prompts]
    finally:
        srv.stop(signal.SIGKILL)  # whatever the writer was doing
    srv = ServerProcess(args, str(tmp_path / "second.log"))
    try:
        assert [_answer(srv.url, p) for p in prompts] == want
        text = httpx.get(srv.url + "/metrics").text
        assert labelled(text, "justapi_prefix_cache_hits_by_tier", tier="disk") > 0
        assert sum(labelled(text, "justapi_prefix_cache_disk_rejected_total", reason=r)
                   for r in ("corrupt", "truncated", "foreign", "unreadable")) == 0
    finally:
        assert srv.stop() == 0
    assert not [f for _, _, names in os.walk(disk) for f in names if f.endswith(".tmp")]


@pytest.fixture
def full_disk(tmp_path):
    """A 64 KiB tmpfs (root only: skipped where mounting is not allowed)."""
    path = tmp_path / "full"
    path.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(path)],
                      capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    yield str(path)
    subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_full_disk_is_survived(tiny_model, full_disk, tmp_path):
    args = ["--model", tiny_model, "--pool-blocks", "64", "--block-size", "4", "--batch-invariant",
            "--prefix-cache-dir", full_disk]
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 250) for _ in range(100)] for _ in range(8)]
    srv = ServerProcess(args, str(tmp_path / "full.log"))
    try:
        first = [_answer(srv.url, p) for p in prompts]
        wait_until(lambda: metric(httpx.get(srv.url + "/metrics").text,
                                  "justapi_prefix_cache_disk_write_errors_total") > 0, 30, "a failed write")
        assert [_answer(srv.url, p) for p in prompts] == first  # still serving, the same answers
        assert httpx.get(srv.url + "/health").status_code == 200
    finally:
        assert srv.stop() == 0
    assert "is full" in srv.read_log()


def test_data_parallel_replicas_share_the_directory(tiny_model, tmp_path):
    """Round robin sends a prompt's second request to the other replica, whose memory never saw it: it reads the
    blocks the first replica wrote. /metrics sums the replicas' disk tiers."""
    from server_helpers import undocumented_metrics

    disk = str(tmp_path / "kv")
    srv = ServerProcess(["--model", tiny_model, "--pool-blocks", "128", "--block-size", "4", "--data-parallel", "2",
                         "--threads", "1", "--router", "round-robin", "--prefix-cache-dir", disk,
                         "--prefix-cache-dir-reads", "always"], str(tmp_path / "dp.log"))
    try:
        shared = [random.Random(9).randrange(3, 250) for _ in range(80)]
        _answer(srv.url, shared + [5])
        files = lambda: sum(f.endswith(".kv") for _, _, names in os.walk(disk) for f in names)  # noqa: E731
        wait_until(lambda: files() >= 20, 30, "the first replica's blocks on disk")
        _answer(srv.url, shared + [6])
        # each replica's counters reach /metrics with its next load report: wait for both replicas' to arrive
        text = wait_until(lambda: (t := httpx.get(srv.url + "/metrics").text) and labelled(
            t, "justapi_prefix_cache_hits_by_tier", tier="disk") >= 20 and metric(
            t, "justapi_prefix_cache_disk_written_blocks_total") >= 20 and t, 30,
            "the second replica's disk hits and the first one's writes")
        assert undocumented_metrics(text) == set()
    finally:
        assert srv.stop() == 0
