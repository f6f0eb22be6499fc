"""The server's line to each worker process: one duplex connection per worker carrying engine.worker_messages both ways,
a pipe on this host or a TCP socket to a worker on another one (a Ray actor). One connection per worker, not one
shared queue: a worker killed while writing to a shared queue would leave its lock taken (and a half-written message
in it), and every other worker would block; a worker's own connection just ends, which reads as its death.

The server never blocks on a send: a feeder thread writes its commands (a worker reads them only between steps,
while the server must keep reading the workers' reports, or both would wait on full socket buffers).
"""

from __future__ import annotations

import multiprocessing.connection as mp_connection
import os
import queue
import socket
import struct
import threading
import time

_CLOSE = object()


class Channel:
    """The server's end of one worker's connection: ``put`` a command (never blocks), read ``conn`` for reports."""

    def __init__(self, conn, name: str) -> None:
        self.conn = conn
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._feeder = threading.Thread(target=self._feed, name=f"justapi-feed-{name}", daemon=True)
        self._feeder.start()

    def put(self, msg) -> None:
        self._queue.put(msg)

    def _feed(self) -> None:
        while (msg := self._queue.get()) is not _CLOSE:
            try:
                self.conn.send(msg)
            except Exception:  # noqa: BLE001 - the worker is gone (or its connection was closed by the reader):
                return  # the server notices its death by the process, or the end of file

    def close(self) -> None:
        """Stop the feeder after what was put so far, then close the connection."""
        self._queue.put(_CLOSE)
        self._feeder.join(timeout=5)
        self.conn.close()


class WorkerLink:
    """A worker's end: ``get`` a command (as queue.Queue's, raising queue.Empty) and ``put`` a report."""

    def __init__(self, conn) -> None:
        self.conn = conn

    def put(self, msg) -> None:
        self.conn.send(msg)

    def get(self, timeout: float | None = None):
        if not self.conn.poll(timeout):
            raise queue.Empty
        return self.conn.recv()

    def get_nowait(self):
        return self.get(0)


HANDSHAKE_S = 10.0  # a dialing peer proves the key and names its rank within this, or is dropped


class WorkerListener:
    """Where workers on other hosts dial the server: each proves the key and says its rank. A stray peer (silent,
    hanging up, without the key, naming no expected rank) is dropped on a thread of its own, holding up no other."""

    def __init__(self, host: str, authkey: bytes) -> None:
        self._sock = socket.create_server((host, 0))
        self.address = self._sock.getsockname()[:2]
        self._authkey = authkey
        self._lock = threading.Lock()
        self._accepted: dict[int, mp_connection.Connection] = {}
        self._expected: set[int] = set()
        threading.Thread(target=self._accept_loop, name="justapi-accept", daemon=True).start()

    def expect(self, rank: int) -> None:
        with self._lock:
            self._expected.add(rank)

    def take(self, ranks: set[int], alive, deadline: float) -> dict[int, mp_connection.Connection]:
        """The connections of ``ranks`` once each has dialed; RuntimeError if one's process ends (``alive(rank)``
        false) or ``deadline`` (time.monotonic) passes first."""
        while True:
            with self._lock:
                if ranks <= self._accepted.keys():
                    return {r: self._accepted.pop(r) for r in ranks}
            dead = [r for r in ranks if not alive(r)]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"worker {dead[0]} ended before connecting" if dead
                                   else "workers did not connect in time")
            time.sleep(0.05)  # polling the workers' processes, which report no event

    def close(self) -> None:
        self._sock.close()

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, _ = self._sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._handshake, args=(sock,), name="justapi-handshake", daemon=True).start()

    def _handshake(self, sock: socket.socket) -> None:
        # a silent peer's reads fail after HANDSHAKE_S (the kernel's receive timeout: the fd stays blocking, as
        # multiprocessing's Connection reads it), and the timeout is lifted for a worker that passes
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", int(HANDSHAKE_S), 0))
        conn = mp_connection.Connection(sock.detach())
        try:
            mp_connection.deliver_challenge(conn, self._authkey)
            mp_connection.answer_challenge(conn, self._authkey)
            rank = conn.recv() if conn.poll(HANDSHAKE_S) else None
        except Exception:  # no key, a hang-up, a timeout, or a message that is no rank: not one of ours
            rank = None
        with self._lock:
            if isinstance(rank, int) and rank in self._expected and rank not in self._accepted:
                self._expected.discard(rank)
                socket.socket(fileno=os.dup(conn.fileno())).setsockopt(  # closing the dup leaves conn's fd open
                    socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 0))
                self._accepted[rank] = conn
                return
        conn.close()


def connect(address: tuple[str, int], authkey: bytes, rank: int):
    """A worker on another host dials the server's listener and says which worker it is."""
    conn = mp_connection.Client(address, authkey=authkey)
    conn.send(rank)
    return conn
