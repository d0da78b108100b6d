"""A request-read deadline for uvicorn's h11 connections (slowloris and half-sent bodies).

uvicorn closes an idle keep-alive connection after ``timeout_keep_alive``, but has no limit
on how long a client may take to send a request: a connection that never sends a byte, one
that sends its headers a byte at a time (slowloris) and one that stops half-way through its
body all stay open for ever, and enough of them exhaust the file limit. This protocol closes
the connection when a request has not fully arrived (headers and body) within
``request_read_timeout`` seconds of its first byte, or of the connection's opening.
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class TimedH11Protocol(H11Protocol):
    """``H11Protocol`` with a deadline on reading each request (``request_read_timeout``,
    seconds; set on the subclass ``with_timeout`` makes)."""

    request_read_timeout: float = 30.0

    @classmethod
    def with_timeout(cls, seconds: float) -> type[TimedH11Protocol]:
        """A subclass with the given deadline (uvicorn builds protocols from a class)."""
        if not seconds > 0:
            raise ValueError(f"request_read_timeout must be > 0 seconds, got {seconds}")
        return type(cls.__name__, (cls,), {"request_read_timeout": float(seconds)})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._read_deadline: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        # A byte of a new request arms the deadline (uvicorn cancels its keep-alive timer on
        # any data, so a slow request after a first one would otherwise have none).
        if self.conn.their_state is h11.IDLE:
            self._arm()
        super().data_received(data)
        self._disarm_if_read()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start the next pipelined request
        self._disarm_if_read()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._read_deadline is None:
            self._read_deadline = self.loop.call_later(self.request_read_timeout, self._read_timed_out)

    def _disarm(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _disarm_if_read(self) -> None:
        # Their state leaves IDLE once the headers are parsed and reaches DONE with the whole
        # body. IDLE after a request with no byte of the next one buffered is the pause
        # between requests, where uvicorn's keep-alive timer takes over.
        state = self.conn.their_state
        between = state is h11.IDLE and self.cycle is not None and not self.conn.trailing_data[0]
        if state is h11.DONE or state is h11.MUST_CLOSE or between:
            self._disarm()

    def _read_timed_out(self) -> None:
        self._read_deadline = None
        if not self.transport.is_closing():
            self.logger.info("closing a connection whose request did not arrive within %.0f s", self.request_read_timeout)
            if self.cycle is not None and not self.cycle.response_complete:
                self.cycle.disconnected = True  # the app sees http.disconnect
                self.cycle.message_event.set()
            self.transport.close()
