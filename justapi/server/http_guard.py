"""uvicorn's HTTP/1.1 protocol with a deadline for each request's head, so a slow or idle client cannot hold a
connection open without sending a request (uvicorn bounds the idle time between requests, not before the first)."""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol

HEAD_TIMEOUT_S = 10.0  # from a connection's start (or its last response) to a whole request line and headers


class GuardedH11Protocol(H11Protocol):
    """H11Protocol that closes a connection whose next request's head has not arrived within HEAD_TIMEOUT_S."""

    head_timeout_s = HEAD_TIMEOUT_S
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._head_timer is None and not self._in_request():
            self._arm()  # the next request on a kept-alive connection starts its own deadline
        super().data_received(data)
        if self._in_request():
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._disarm()  # uvicorn's keep-alive timeout bounds the wait for the next request's first byte

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _in_request(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self._in_request() and not self.transport.is_closing():
            self.transport.close()
