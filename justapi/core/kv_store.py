"""The prefix cache's disk tier: KV blocks kept as files in a directory, found again after eviction or a restart.

A block is named by its place in a token chain: its key hashes the key of the block before it with its own token
ids, the first block's "before" being the fingerprint of the model and KV layout (``fingerprint``), so the same
prompt prefix under the same model finds the same files in any process on the host (replicas share a directory) and
a file never answers for another model. One file a block: a magic line, a JSON header (fingerprint, key, token ids,
payload length, the payload's XXH3-64: a block's read is mostly its check, and XXH3 runs ~4x zlib's CRC-32 here) and
the payload, the block's K and V of every layer as the runner stores them.

Files are written whole under a temporary name and renamed, by a writer thread off the engine's: a process killed
mid-write leaves a temporary file (removed at the next start once its writer is gone), never a half block. A read
checks everything the header says; a file that fails is counted by why, removed and never loaded into a sequence.
The directory is held under its size bound by removing the least recently used files (a read touches its file).
Reads are worth their time only where they beat the prefill they save: both are measured (``worth_reading``).
Pure Python, no torch: payloads are bytes-like.
"""

from __future__ import annotations

import array
import dataclasses
import errno
import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time

import xxhash

log = logging.getLogger("justapi.kv_store")

MAGIC = b"JUSTAPI-KV 1\n"
FORMAT_VERSION = 1  # in the fingerprint: files of another format are another model's
SUFFIX = ".kv"
MAX_PENDING_BYTES = 256 << 20  # payloads queued for the writer at most; past it a block is not written (counted)
PROBE_EVERY = 64  # lookups between reads made anyway while reads measure slower than prefill (to re-measure)
MAX_KNOWN = 1 << 20  # keys remembered as on disk (a cache of what exists: cleared, not grown, past this)
RESCAN_S = 60.0  # a writer counts the shared directory again at least this often (replicas, other models)
FREE_WHEN_FULL = 64  # blocks' worth of the oldest files removed when the disk is full
_SAMPLES, _SAMPLE_BYTES, _HEAD_BYTES = 64, 64 << 10, 4 << 20


def fingerprint(model_path: str, layout: dict) -> str:
    """What KV computed from this file under this layout (KV dtype, block size, compute dtype, the model's config)
    depends on: the file's size, its first 4 MiB (header, metadata, tensor table) and 64 samples of its tensor data,
    and ``layout``. Reads a few MiB whatever the file's size."""
    h = hashlib.sha256(json.dumps({"format": FORMAT_VERSION, **layout}, sort_keys=True, default=str).encode())
    size = os.path.getsize(model_path)
    h.update(struct.pack("<Q", size))
    with open(model_path, "rb") as f:
        h.update(f.read(_HEAD_BYTES))
        for i in range(_SAMPLES):
            f.seek(size * i // _SAMPLES)
            h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()[:32]


def chain_keys(seed: str, token_ids: list[int], block_size: int, num_blocks: int) -> list[str]:
    """The keys of the first ``num_blocks`` whole blocks of ``token_ids``: each hashes the one before it (the first:
    ``seed``, the fingerprint) with its own tokens."""
    keys, prev = [], bytes.fromhex(seed)
    for i in range(num_blocks):
        block = array.array("q", token_ids[i * block_size : (i + 1) * block_size]).tobytes()
        prev = hashlib.blake2b(prev + block, digest_size=16).digest()
        keys.append(prev.hex())
    return keys


@dataclasses.dataclass
class KvStoreStats:
    """What the disk tier did (copied for readers on other threads)."""

    loaded_blocks: int = 0  # blocks read back into sequences
    read_bytes: int = 0
    read_seconds: float = 0.0
    written_blocks: int = 0
    written_bytes: int = 0
    saved_seconds: float = 0.0  # the prefill the loaded blocks would have cost, less their reads (once measured)
    rejected: dict[str, int] = dataclasses.field(default_factory=dict)  # files refused, by why
    write_errors: int = 0  # writes that failed (disk full, ...); the block stays in memory only
    dropped: int = 0  # blocks not written because the writer was MAX_PENDING_BYTES behind
    evicted_files: int = 0  # removed to keep the directory under its bound
    disk_bytes: int = 0  # the directory's size as this process last counted it
    max_bytes: int = 0

    def copy(self) -> KvStoreStats:
        return dataclasses.replace(self, rejected=dict(self.rejected))


def merged(stats: list[KvStoreStats]) -> KvStoreStats:
    """Several processes' counters as one (replicas sharing a directory: its size is each one's count of it)."""
    total = KvStoreStats()
    for s in stats:
        for f in dataclasses.fields(KvStoreStats):
            if f.name == "rejected":
                for why, n in s.rejected.items():
                    total.rejected[why] = total.rejected.get(why, 0) + n
            elif f.name in ("disk_bytes", "max_bytes"):
                setattr(total, f.name, max(getattr(total, f.name), getattr(s, f.name)))
            else:
                setattr(total, f.name, getattr(total, f.name) + getattr(s, f.name))
    return total


class KvStore:
    """One process's view of a disk-tier directory for one model: ``has``/``read`` on the engine thread, ``write``
    queued to the writer thread."""

    def __init__(self, root: str, max_bytes: int, fingerprint: str, block_bytes: int, reads: str = "auto") -> None:
        """``block_bytes``: one block's payload (every file of this model and layout holds exactly that many);
        ``reads``: "auto", read where it measures faster than prefill, or "always" (config.DISK_READ_POLICIES)."""
        self.root = root
        self.reads = reads
        self.fingerprint = fingerprint
        self.block_bytes = block_bytes
        self.dir = os.path.join(root, fingerprint)
        os.makedirs(self.dir, exist_ok=True)
        self.stats = KvStoreStats(max_bytes=max_bytes)
        self._known: set[str] = set()  # keys on disk as far as this process knows (others may add or remove)
        self._read_s_per_block = 0.0  # measured, EWMA (0: not yet)
        self._prefill_s_per_token = 0.0  # measured by the engine, EWMA (0: not yet)
        self._lookups = 0
        self._pending = 0  # bytes queued for the writer
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._scanned = 0.0
        self._scan(remove_stale=True)
        self._writer = threading.Thread(target=self._write_loop, name="justapi-kv-store", daemon=True)
        self._writer.start()

    # --- the engine thread -------------------------------------------------------------------------------------
    def path(self, key: str) -> str:
        return os.path.join(self.dir, key[:2], key + SUFFIX)

    def _remember(self, key: str) -> None:
        if len(self._known) >= MAX_KNOWN:
            self._known.clear()  # what is on disk is asked of the disk again (has)
        self._known.add(key)

    def has(self, key: str) -> bool:
        return key in self._known or os.path.exists(self.path(key))

    def worth_reading(self, block_size: int) -> bool:
        """Whether reading a block beats computing its ``block_size`` tokens, as measured on this machine: yes until
        both are measured, and once in PROBE_EVERY lookups where reads lost (to measure them again); always yes
        under ``reads="always"``. (On the Xeon measured a SmolLM2 block reads in ~0.3 ms, its 16 tokens prefill in
        ~9 ms; a tiny model's can compute faster than it reads.)"""
        self._lookups += 1
        if self.reads == "always" or not (self._read_s_per_block and self._prefill_s_per_token):
            return True
        return (self._read_s_per_block < self._prefill_s_per_token * block_size
                or self._lookups % PROBE_EVERY == 0)

    def note_prefill(self, seconds: float, tokens: int) -> None:
        """A step that computed ``tokens`` prompt tokens in ``seconds`` (the engine's measurement)."""
        if tokens > 0:
            self._prefill_s_per_token = _ewma(self._prefill_s_per_token, seconds / tokens)

    def read(self, key: str, token_ids: list[int], into: memoryview) -> bool:
        """Whether ``key``'s file holds exactly this block of ``token_ids`` for this model and layout, its payload
        then read ``into`` (``block_bytes`` long: a slice of one buffer for a whole run of blocks, since allocating
        each block's alone costs a map and unmap a block); False where there is no such file or it fails a check
        (then it is removed and counted by why)."""
        path = self.path(key)
        t0 = time.perf_counter()
        try:
            with open(path, "rb") as f:
                why = self._parse(f, key, token_ids, into)
        except FileNotFoundError:
            self._known.discard(key)
            return False
        except OSError as e:
            why = f"unreadable ({e.strerror})"
        if why:
            self._reject(path, key, why)
            return False
        seconds = time.perf_counter() - t0
        with self._lock:
            self.stats.read_bytes += self.block_bytes
            self.stats.read_seconds += seconds
        self._read_s_per_block = _ewma(self._read_s_per_block, seconds)
        self._remember(key)
        try:
            os.utime(path)  # least recently used goes first
        except OSError:
            pass
        return True

    def loaded(self, blocks: int, block_size: int) -> None:
        """``blocks`` read went into a sequence: count them, and the prefill they saved (as measured: never below 0)."""
        with self._lock:
            self.stats.loaded_blocks += blocks
            if self._prefill_s_per_token:
                saved = self._prefill_s_per_token * block_size - self._read_s_per_block
                self.stats.saved_seconds += blocks * max(0.0, saved)

    def room(self, blocks: int) -> int:
        """How many of ``blocks`` the writer's queue takes now; the rest are counted as dropped."""
        with self._lock:
            fit = max(0, min(blocks, (MAX_PENDING_BYTES - self._pending) // self.block_bytes))
            self.stats.dropped += blocks - fit
            return fit

    def _parse(self, f, key: str, token_ids: list[int], into: memoryview) -> str:
        """Why the open file fails its checks ("" where it passes, its payload then in ``into``)."""
        if f.read(len(MAGIC)) != MAGIC:
            return "corrupt"
        try:
            (length,) = struct.unpack("<I", f.read(4))
            header = json.loads(f.read(min(length, 1 << 20)))
        except (struct.error, ValueError, UnicodeDecodeError, RecursionError):
            return "corrupt"
        if not isinstance(header, dict) or header.get("fingerprint") != self.fingerprint:
            return "foreign"
        if header.get("key") != key or header.get("tokens") != list(token_ids):
            return "foreign"
        if header.get("nbytes") != self.block_bytes:
            return "foreign"
        if f.readinto(into) != self.block_bytes or f.read(1):
            return "truncated"
        if xxhash.xxh3_64_intdigest(into) != header.get("xxh3_64"):
            return "corrupt"
        return ""

    def _reject(self, path: str, key: str, why: str) -> None:
        log.warning("prefix cache disk tier: %s is %s; skipped and removed", path, why)
        with self._lock:
            reason = why.split(" ")[0]
            self.stats.rejected[reason] = self.stats.rejected.get(reason, 0) + 1
        self._known.discard(key)
        _remove(path)

    def write(self, key: str, token_ids: list[int], payload) -> None:
        """Queue a block for the writer: ``payload`` is bytes-like (kept unchanged until written) or a function the
        writer calls for it (a copy made off the engine thread); dropped and counted where the writer is too far
        behind."""
        size = self.block_bytes
        with self._lock:
            if self._pending + size > MAX_PENDING_BYTES:
                self.stats.dropped += 1
                return
            self._pending += size
        self._remember(key)
        self._queue.put((key, list(token_ids), payload, size))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued is written (or ``timeout`` seconds); whether it was."""
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued (up to ``timeout`` seconds) and stop the writer."""
        self.flush(timeout)
        self._queue.put(None)

    def snapshot(self) -> KvStoreStats:
        with self._lock:
            return self.stats.copy()

    # --- the writer thread -------------------------------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            key, token_ids, payload, size = item
            try:
                self._write_file(key, token_ids, payload() if callable(payload) else payload)
            except Exception:  # the writer never dies: a block not written is only a later miss
                self._known.discard(key)
                log.exception("prefix cache disk tier: writing %s failed", key)
            finally:
                with self._lock:
                    self._pending -= size

    def _write_file(self, key: str, token_ids: list[int], payload) -> None:
        path = self.path(key)
        if os.path.exists(path):
            return
        if memoryview(payload).nbytes != self.block_bytes:
            raise ValueError(f"a block of {memoryview(payload).nbytes} bytes, not {self.block_bytes}")
        header = json.dumps({"fingerprint": self.fingerprint, "key": key, "tokens": token_ids,
                             "nbytes": self.block_bytes, "xxh3_64": xxhash.xxh3_64_intdigest(payload)}).encode()
        data = MAGIC + struct.pack("<I", len(header)) + header
        tmp = f"{path}.{os.getpid()}-{id(self)}.tmp"  # the process (its writer's liveness: _writer_alive), the store
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
                f.write(payload)
            os.replace(tmp, path)
        except OSError as e:
            _remove(tmp)
            self._known.discard(key)
            with self._lock:
                self.stats.write_errors += 1
            if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):  # make room for the next ones
                log.warning("prefix cache disk tier: %s is full (%s); removing its oldest blocks", self.root,
                            e.strerror)
                self._scan(free=FREE_WHEN_FULL * self.block_bytes)
            else:
                log.warning("prefix cache disk tier: cannot write %s: %s", path, e)
            return
        with self._lock:
            self.stats.written_blocks += 1
            self.stats.written_bytes += len(data) + self.block_bytes
            self.stats.disk_bytes += len(data) + self.block_bytes
            over = self.stats.disk_bytes > self.stats.max_bytes
        # the others sharing the directory write too: counted again now and then, not only past this one's count
        if over or time.monotonic() - self._scanned > RESCAN_S:
            self._scan(target=self.stats.max_bytes * 9 // 10)

    def _scan(self, target: int | None = None, free: int = 0, remove_stale: bool = False) -> None:
        """Count the whole directory (every model's files, every process's); with ``target``, remove the least
        recently used files until it holds at most that many bytes (``free``: until that many bytes fewer than
        counted); with ``remove_stale``, temporary files whose writer is gone."""
        self._scanned = time.monotonic()
        files, total = [], 0
        for dirpath, _, names in os.walk(self.root):
            for name in names:
                path = os.path.join(dirpath, name)
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                if name.endswith(".tmp"):
                    if remove_stale and not _writer_alive(name):
                        _remove(path)
                    continue
                if name.endswith(SUFFIX):
                    files.append((st.st_mtime, st.st_size, path))
                    total += st.st_size
                    if dirpath.startswith(self.dir):
                        self._remember(name[: -len(SUFFIX)])
        evicted = 0
        if free:
            target = total - free
        if target is not None and total > target:
            files.sort()
            for _, size, path in files:
                if total <= target:
                    break
                if _remove(path):
                    total -= size
                    evicted += 1
                    self._known.discard(os.path.basename(path)[: -len(SUFFIX)])
        with self._lock:
            self.stats.disk_bytes = total
            self.stats.evicted_files += evicted
        if remove_stale and total > self.stats.max_bytes:
            self._scan(target=self.stats.max_bytes * 9 // 10)


def _ewma(old: float, new: float) -> float:
    return new if old == 0 else 0.8 * old + 0.2 * new


def _remove(path: str) -> bool:
    try:
        os.remove(path)
        return True
    except OSError:
        return False


def _writer_alive(tmp_name: str) -> bool:
    """Whether the process named in a temporary file's name (KEY.kv.PID-STORE.tmp) still runs."""
    try:
        pid = int(tmp_name.split(".")[-2].split("-")[0])
        os.kill(pid, 0)
    except (ValueError, IndexError, ProcessLookupError):
        return False
    except PermissionError:  # someone else's process
        return True
    return True
