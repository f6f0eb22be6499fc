"""Grammars compiled in worker processes. A thread cannot be stopped, so a compile past its time limit is ended by
ending its process, and one slow or hostile schema never holds up the others (each worker takes one at a time);
each worker's memory is capped, so a schema that explodes kills its worker, not the server."""

from __future__ import annotations

import logging
import multiprocessing
import queue
import resource
import time

log = logging.getLogger(__name__)

WORKER_MEMORY_BYTES = 8 << 30  # address space a compile worker may map (xgrammar and its imports need ~1 GiB)


class CompileError(Exception):
    """The worker refused the grammar (its message), ran out of time, or died compiling it."""


class CompileWorkers:
    """``num_workers`` processes, each with the vocabulary's compiler, compiling serialized specs on demand."""

    def __init__(self, tokenizer_info_json: str, num_workers: int = 2) -> None:
        self._info = tokenizer_info_json
        self._context = multiprocessing.get_context("spawn")  # never fork a process running torch's threads
        self._idle: queue.Queue = queue.Queue()
        for _ in range(num_workers):
            self._idle.put(self._start())

    def compile(self, spec, timeout_s: float) -> str:
        """``spec`` (a StructuredOutput) compiled within ``timeout_s`` seconds, waiting for a free worker included:
        xgrammar's serialized CompiledGrammar. Raises CompileError."""
        deadline = time.monotonic() + timeout_s
        try:
            worker = self._idle.get(timeout=timeout_s)
        except queue.Empty:
            raise CompileError(f"no grammar compiler was free within {timeout_s:g} s (the server is busy)") from None
        try:
            worker = self._ready(worker)
            worker[1].send(spec)
            if not worker[1].poll(max(0.0, deadline - time.monotonic())):
                self._stop(worker)
                worker = self._start()
                raise CompileError(f"the constraint did not compile within {timeout_s:g} s")
            ok, result = worker[1].recv()
        except (EOFError, OSError, BrokenPipeError):
            self._stop(worker)
            worker = self._start()
            raise CompileError("the constraint's compiler process died (out of memory?)") from None
        finally:
            self._idle.put(worker)
        if not ok:
            raise CompileError(result)
        return result

    def close(self) -> None:
        while not self._idle.empty():
            self._stop(self._idle.get_nowait())

    def _start(self):
        parent, child = self._context.Pipe()
        proc = self._context.Process(target=_serve, args=(child, self._info), name="justapi-grammar", daemon=True)
        proc.start()
        child.close()
        return proc, parent

    def _ready(self, worker):
        """The worker, or a new one in its place where it has died since its last compile."""
        if worker[0].is_alive():
            return worker
        self._stop(worker)
        return self._start()

    @staticmethod
    def _stop(worker) -> None:
        proc, conn = worker
        proc.kill()
        proc.join(timeout=5)
        conn.close()


def _serve(conn, tokenizer_info_json: str) -> None:
    """A worker: build the compiler once, then compile each spec sent until the pipe closes."""
    resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_BYTES, WORKER_MEMORY_BYTES))
    import xgrammar as xgr

    from .grammars import compile_spec

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(tokenizer_info_json), max_threads=1,
                                   cache_enabled=False)
    while True:
        try:
            spec = conn.recv()
        except EOFError:
            return
        try:
            conn.send((True, compile_spec(xgr, compiler, spec).serialize_json()))
        except Exception as e:  # the client's grammar: its message goes back
            conn.send((False, str(e)))
