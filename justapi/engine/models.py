"""Several models behind one server: a registry from a model's name (or alias) to the process serving it
(engine.model_process), loaded on its first request, unloaded when idle, within a memory budget.

A request ``acquire``s its model (loading it if needed: the requests for a loading model wait on the one load) and
``release``s it when its answer is sent; a model with a request in flight or waiting is never unloaded. An idle model
unloads ``idle_unload_s`` after its last request, or as that request's ``keep_alive`` says (0: at once; negative:
never). Loading a model reserves its file's size, a process's overhead and its KV pool from the budget; the KV pool
is ``kv_fraction`` of the budget or what is left of it, the smaller (the child gets it as --kv-memory). Where the
budget or ``max_loaded`` has no room, the least recently used idle models are unloaded first; where only busy models
hold it, the request is refused (503) rather than queued behind them indefinitely.

Runs on the server's event loop: no locks but the one that makes a load's budget decision and its evictions atomic.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from dataclasses import dataclass, field

from .model_process import LoadFailed, ModelProcess

log = logging.getLogger("justapi.models")
PROCESS_BYTES = 600 * 2**20  # what a model's process takes besides its weights and KV (Python, torch, the server)
MIN_KV_BYTES = 64 * 2**20  # the smallest KV pool a model is started with
REAP_INTERVAL_S = 0.25  # how often idle expiries and dead processes are looked for
# a model that failed to load is not tried again for this long unless its file changes: every request would
# otherwise start (and fail) a process, seconds of CPU each
FAILED_RETRY_S = 60.0


class ModelUnavailable(Exception):
    """A request's model cannot serve it: unknown (404), failed to load, died, or no room (503)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class ModelSpec:
    """A model the server may load: its name, its file, its aliases and flags of its own (models.toml)."""

    name: str
    path: str
    aliases: tuple[str, ...] = ()
    flags: tuple[str, ...] = ()


@dataclass(frozen=True)
class ModelsConfig:
    """How the registry loads and unloads: ``child_flags``, the serve flags every model's process gets."""

    budget_bytes: int
    idle_unload_s: float
    max_loaded: int | None = None
    kv_fraction: float = 0.25
    kv_bytes: int | None = None  # --kv-memory given: every model's KV pool this size
    load_timeout_s: float = 600.0
    child_flags: tuple[str, ...] = ()


@dataclass
class ModelSlot:
    """A model's state in the registry."""

    spec: ModelSpec
    state: str = "unloaded"  # unloaded, loading, loaded, failed
    process: ModelProcess | None = None
    loading: asyncio.Future | None = None
    stopping: asyncio.Task | None = None
    in_flight: int = 0
    waiting: int = 0
    last_used: float = 0.0
    expires: float | None = None  # when it unloads if idle (time.monotonic()); None: never
    expiry_reason: str = "idle"  # what set it: idle (--idle-unload) or keep_alive (a request's)
    reserved: int = 0  # bytes of the budget it holds
    error: str | None = None
    failed: tuple[float, tuple] | None = None  # when its latest load failed, and its file's (size, mtime) then
    loads: int = 0
    load_failures: int = 0
    load_seconds: float | None = None  # its latest load's
    unloads: collections.Counter = field(default_factory=collections.Counter)  # by reason

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def busy(self) -> bool:
        return self.in_flight > 0 or self.waiting > 0 or self.state == "loading"


class ModelSet:
    """The registry: names to slots, loads and unloads, the budget."""

    def __init__(self, specs: list[ModelSpec], config: ModelsConfig) -> None:
        self.config = config
        self.slots = {s.name: ModelSlot(s) for s in specs}
        self.names = {name: s.name for s in specs for name in (s.name, *s.aliases)}
        self.default = specs[0].name
        self._room = asyncio.Lock()
        self._reaper: asyncio.Task | None = None

    def resolve(self, name: str | None) -> ModelSlot:
        """The slot a request's model name (or alias; None: the first model) names; ModelUnavailable(404) else."""
        canonical = self.names.get(name if name is not None else self.default)
        if canonical is None:
            raise ModelUnavailable(404, f"the model {name!r} does not exist; this server serves "
                                        f"{', '.join(repr(n) for n in self.slots)}")
        return self.slots[canonical]

    async def acquire(self, name: str | None) -> ModelSlot:
        """The model's slot, loaded, with this request counted in flight (``release`` it when done)."""
        slot = self.resolve(name)
        if slot.state == "failed" and slot.failed is not None and not self._worth_retrying(slot):
            raise ModelUnavailable(503, slot.error or "")
        slot.waiting += 1
        try:
            while slot.state != "loaded":
                if slot.loading is None:
                    slot.loading = asyncio.ensure_future(self._load(slot))
                await asyncio.shield(slot.loading)
        finally:
            slot.waiting -= 1
        slot.in_flight += 1
        return slot

    def _worth_retrying(self, slot: ModelSlot) -> bool:
        """A failed load is tried again once FAILED_RETRY_S have passed or its file changed."""
        assert slot.failed is not None
        when, stat = slot.failed
        return time.monotonic() - when > FAILED_RETRY_S or _file_stat(slot.spec.path) != stat

    def release(self, slot: ModelSlot, keep_alive: float | None = None) -> None:
        """A request is done with its model: it stays ``keep_alive`` seconds more (None: idle_unload_s; negative:
        until evicted) once nothing else uses it."""
        slot.in_flight -= 1
        slot.last_used = time.monotonic()
        self.keep(slot, keep_alive)

    def keep(self, slot: ModelSlot, keep_alive: float | None) -> None:
        """The model stays ``keep_alive`` seconds after its last request (None: idle_unload_s; negative: until
        evicted); the reaper unloads it then, once nothing uses it."""
        keep = self.config.idle_unload_s if keep_alive is None else keep_alive
        slot.expires = None if keep < 0 else time.monotonic() + keep
        slot.expiry_reason = "idle" if keep_alive is None else "keep_alive"

    async def _load(self, slot: ModelSlot) -> None:
        try:
            if slot.stopping is not None:
                await slot.stopping
            kv_bytes = await self._make_room(slot)
            slot.state, slot.error = "loading", None
            log.info("loading %s (%s) with a KV pool of %.2f GiB", slot.name, slot.spec.path, kv_bytes / 2**30)
            process = await self._started(slot.spec, kv_bytes)
            slot.process, slot.state, slot.loads, slot.failed = process, "loaded", slot.loads + 1, None
            slot.last_used = time.monotonic()
            slot.expires, slot.expiry_reason = slot.last_used + self.config.idle_unload_s, "idle"
            log.info("loaded %s in %.1f s", slot.name, slot.load_seconds)
        except ModelUnavailable:  # no room (nothing of it started): the request says why, the model stays as it was
            if slot.state == "loading":
                slot.state, slot.reserved = "unloaded", 0
            raise
        except Exception as e:  # LoadFailed, or anything else on the way: remembered, answered with why
            why = str(e) if isinstance(e, LoadFailed) else f"{type(e).__name__}: {e}"
            slot.state, slot.error, slot.reserved = "failed", f"the model {slot.name!r} failed to load: {why}", 0
            slot.failed = (time.monotonic(), _file_stat(slot.spec.path))
            slot.load_failures += 1
            log.error(slot.error)
            raise ModelUnavailable(503, slot.error) from None
        except BaseException:
            if slot.state == "loading":
                slot.state, slot.reserved = "unloaded", 0
            raise
        finally:
            slot.loading = None

    async def _started(self, spec: ModelSpec, kv_bytes: int) -> ModelProcess:
        """The model's process, serving; started again on another port where its port was taken meanwhile."""
        for attempt in range(3):
            process = ModelProcess(spec.name, ["--model", spec.path, "--served-model-name", spec.name,
                                               "--kv-memory", str(kv_bytes), *self.config.child_flags, *spec.flags])
            try:
                self.slots[spec.name].load_seconds = await process.start(self.config.load_timeout_s)
                return process
            except LoadFailed as e:
                if attempt == 2 or not ("address already in use" in str(e) or "another server" in str(e)):
                    raise
        raise AssertionError("unreachable")

    def _needs(self, spec: ModelSpec) -> int:
        """Bytes a model takes besides its KV pool: its file (weights stay packed as stored) and its process."""
        try:
            return os.path.getsize(spec.path) + PROCESS_BYTES
        except OSError as e:
            raise LoadFailed(f"its file {spec.path} cannot be read ({e.strerror})") from None

    async def _make_room(self, slot: ModelSlot) -> int:
        """Reserve the model's share of the budget, unloading idle models (least recently used first) where there
        is no room; its KV pool's bytes. ModelUnavailable(503) where busy models hold the room."""
        cfg = self.config
        needs = self._needs(slot.spec)
        smallest = cfg.kv_bytes or MIN_KV_BYTES
        if needs + smallest > cfg.budget_bytes:
            raise ModelUnavailable(503, f"the model {slot.name!r} needs {(needs + smallest) / 2**30:.2f} GiB, more "
                                        f"than the models' memory budget of {cfg.budget_bytes / 2**30:.2f} GiB")
        async with self._room:
            while True:
                others = [s for s in self.slots.values() if s is not slot and s.reserved]
                left = cfg.budget_bytes - sum(s.reserved for s in others) - needs
                count_ok = cfg.max_loaded is None or len(others) < cfg.max_loaded
                if left >= smallest and count_ok:
                    break
                stopping = [s.stopping for s in others if s.stopping is not None]
                if stopping:  # unloading already: its room comes back once its process has exited
                    await asyncio.gather(*stopping, return_exceptions=True)
                    continue
                idle = [s for s in others if s.state == "loaded" and not s.busy]
                if not idle:
                    held = ", ".join(repr(s.name) for s in others)
                    why = (f"--max-loaded-models {cfg.max_loaded}" if not count_ok
                           else f"the models' memory budget of {cfg.budget_bytes / 2**30:.2f} GiB")
                    raise ModelUnavailable(503, f"no room to load {slot.name!r}: {why} is held by models serving "
                                                f"requests ({held}); retry when they finish")
                await self.unload(min(idle, key=lambda s: s.last_used), "evicted")
            kv_bytes = cfg.kv_bytes or min(int(cfg.kv_fraction * cfg.budget_bytes), left)
            slot.reserved = needs + kv_bytes
            return kv_bytes

    async def unload(self, slot: ModelSlot, reason: str) -> None:
        """Stop the model's process; its reservation is returned once the process has exited."""
        process, slot.process = slot.process, None
        slot.state, slot.expires = "unloaded", None
        slot.unloads[reason] += 1
        log.info("unloading %s (%s)", slot.name, reason)
        if process is not None:
            slot.stopping = asyncio.ensure_future(process.stop())
            try:
                await slot.stopping
            finally:
                slot.stopping = None
        slot.reserved = 0

    def start(self) -> None:
        """Begin watching for idle models and dead processes (on the running loop)."""
        self._reaper = asyncio.ensure_future(self._reap())

    async def _reap(self) -> None:
        while True:
            now = time.monotonic()
            for slot in list(self.slots.values()):
                if slot.state != "loaded" or slot.process is None:
                    continue
                if slot.process.exited is not None:
                    code, slot.process = slot.process.exited, None
                    slot.state, slot.reserved = "failed", 0
                    slot.error = f"the model {slot.name!r} stopped: its process exited with status {code}"
                    slot.unloads["died"] += 1
                    log.error(slot.error)
                elif not slot.busy and slot.expires is not None and now >= slot.expires:
                    await self.unload(slot, slot.expiry_reason)
            await asyncio.sleep(REAP_INTERVAL_S)

    def died(self, slot: ModelSlot) -> str | None:
        """Why a request to the model's process failed, where its process has exited (None while it runs)."""
        code = slot.process.exited if slot.process is not None else None
        return None if code is None else f"the model {slot.name!r} stopped: its process exited with status {code}"

    def listing(self) -> list[dict]:
        """Each model's name, file, aliases and state, for the listing routes and the chat page."""
        now = time.monotonic()
        return [dict(name=s.name, path=s.spec.path, aliases=list(s.spec.aliases), state=s.state, error=s.error,
                     size=os.path.getsize(s.spec.path) if os.path.exists(s.spec.path) else 0,
                     in_flight=s.in_flight, waiting=s.waiting, reserved_bytes=s.reserved,
                     pid=s.process.proc.pid if s.process is not None and s.process.proc is not None else None,
                     load_seconds=s.load_seconds,
                     expires_in=None if s.expires is None or s.state != "loaded" else max(0.0, s.expires - now))
                for s in self.slots.values()]

    async def close(self) -> None:
        """Stop the reaper and every model's process."""
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
        await asyncio.gather(*(s.process.stop() for s in self.slots.values() if s.process is not None),
                             return_exceptions=True)


def _file_stat(path: str) -> tuple:
    """(size, mtime) of a model's file, or () where it is gone: what tells a fixed file from the one that failed."""
    try:
        st = os.stat(path)
    except OSError:
        return ()
    return (st.st_size, st.st_mtime_ns)
