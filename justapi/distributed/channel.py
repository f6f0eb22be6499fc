"""The server's line to each worker process: one duplex connection per worker carrying engine.pd_messages both ways,
a pipe on this host or a TCP socket to a worker on another one (a Ray actor). One connection per worker, not one
shared queue: a worker killed while writing to a shared queue would leave its lock taken (and a half-written message
in it), and every other worker would block; a worker's own connection just ends, which reads as its death.

The server never blocks on a send: a feeder thread writes its commands (a worker reads them only between steps,
while the server must keep reading the workers' reports, or both would wait on full socket buffers).
"""

from __future__ import annotations

import multiprocessing.connection as mp_connection
import queue
import threading

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


def connect(address: tuple[str, int], authkey: bytes, rank: int):
    """A worker on another host dials the server's listener and says which worker it is."""
    conn = mp_connection.Client(address, authkey=authkey)
    conn.send(rank)
    return conn
