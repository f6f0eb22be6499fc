"""Grammars compiled in worker processes. A thread cannot be stopped, so a compile past its time limit is ended by
ending its process, and one slow or hostile schema never holds up the others (each worker takes one at a time);
each worker's memory is capped, so a schema that explodes kills its worker, not the server."""

from __future__ import annotations

import queue
import resource
import socket
import subprocess
import sys
from multiprocessing.connection import Connection

WORKER_MEMORY_BYTES = 8 << 30  # address space a compile worker may map (xgrammar and its imports need ~1 GiB)
WORKER_START_S = 120.0  # a new worker's start (Python, xgrammar, the vocabulary), not counted in a compile's time


class CompileError(Exception):
    """The worker refused the grammar (its message), ran out of time, or died compiling it."""


class _CompileProcess:
    """One compile process, ``python -m`` this module (neither a fork of a process running torch's threads, nor
    multiprocessing's spawn, which would run the caller's main script again), on one end of a socket pair."""

    def __init__(self, tokenizer_info_json: str) -> None:
        parent, child = socket.socketpair()
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", __name__, str(child.fileno())],
                                         pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL)
        except OSError as e:
            parent.close()
            raise CompileError(f"the grammar compiler could not start: {e}") from None
        finally:
            child.close()
        self.conn = Connection(parent.detach())
        try:
            self.conn.send(tokenizer_info_json)
        except OSError:
            pass  # it died at once: the first compile finds it dead and starts another
        self.ready = False
        self.sent = 0  # specs sent: each answer carries its number

    def wait_ready(self) -> None:
        """Block until the worker has built its compiler (it says so once)."""
        if not self.ready:
            if not self.conn.poll(WORKER_START_S):
                raise CompileError(f"the grammar compiler did not start within {WORKER_START_S:g} s")
            self.conn.recv()
            self.ready = True

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=5)
        self.conn.close()


class CompileWorkers:
    """``num_workers`` processes, each with the vocabulary's compiler, compiling specs on demand."""

    def __init__(self, tokenizer_info_json: str, num_workers: int = 2) -> None:
        self._info = tokenizer_info_json
        self._idle: queue.Queue[_CompileProcess] = queue.Queue()
        for _ in range(num_workers):
            self._idle.put(_CompileProcess(self._info))

    def compile(self, spec, timeout_s: float) -> str:
        """``spec`` (a StructuredOutput) compiled within ``timeout_s`` seconds of a worker taking it (a free worker
        awaited as long again): xgrammar's serialized CompiledGrammar. Raises CompileError."""
        try:
            worker = self._idle.get(timeout=timeout_s)
        except queue.Empty:
            raise CompileError(f"no grammar compiler was free within {timeout_s:g} s (the server is busy)") from None
        try:
            if not worker.alive():
                worker.stop()
                worker = _CompileProcess(self._info)
            worker.wait_ready()
            worker.sent += 1
            worker.conn.send((worker.sent, spec))
            if not worker.conn.poll(timeout_s):
                worker.stop()
                worker = _CompileProcess(self._info)
                raise CompileError(f"the constraint did not compile within {timeout_s:g} s")
            seq, ok, result = worker.conn.recv()
            if seq != worker.sent:  # never seen; but an answer must never reach another request
                raise OSError(f"the compile worker answered request {seq}, not {worker.sent}")
        except (EOFError, OSError, ValueError, TypeError):
            worker.stop()
            worker = _CompileProcess(self._info)
            raise CompileError("the constraint's compiler process died (out of memory?)") from None
        finally:
            self._idle.put(worker)
        if not ok:
            raise CompileError(result)
        return result

    def close(self) -> None:
        while not self._idle.empty():
            self._idle.get_nowait().stop()


def _serve(conn: Connection) -> None:
    """A worker: build the compiler from the vocabulary sent first, say so, then compile each spec sent until the
    pipe closes."""
    tokenizer_info_json = conn.recv()
    resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_BYTES, WORKER_MEMORY_BYTES))
    import xgrammar as xgr

    from .compile import compile_spec

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(tokenizer_info_json), max_threads=1,
                                   cache_enabled=False)
    conn.send("ready")
    while True:
        try:
            seq, spec = conn.recv()
        except (EOFError, OSError):  # the server closed the pipe, or exited without closing it
            return
        try:
            conn.send((seq, True, compile_spec(xgr, compiler, spec).serialize_json()))
        except Exception as e:  # the client's grammar: its message goes back
            conn.send((seq, False, str(e)))


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1])))
