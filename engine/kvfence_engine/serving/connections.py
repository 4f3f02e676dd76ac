"""The header deadline: a connection must finish a request's headers within `HEADER_SECONDS`
of opening, or of its previous response, or it is closed (issue 33, finding 3).

uvicorn has no such limit: its keep-alive timer starts only after a response and stops at the
first byte that arrives, so a client that sends a header line now and then (or keeps sending a
body nobody reads, after a 401) holds its connection for as long as it likes. `HeaderDeadline`
is uvicorn's h11 protocol with that one timer added; the body has its own deadline
(serving/limits.py).
"""

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_SECONDS = 10.0
# How long a server of ours keeps an idle keep-alive connection (uvicorn's timeout_keep_alive),
# and how long a client of ours (the router's to the engines) keeps one: shorter, so it never
# sends a request on a connection the server is closing at that moment (which reads as
# "server disconnected" and takes a healthy engine out of rotation).
IDLE_SECONDS = 5.0
CLIENT_IDLE_SECONDS = 2.0


class HeaderDeadline(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, closing a connection whose next request's headers are not
    complete `header_seconds` after it opened or answered."""

    header_seconds = HEADER_SECONDS
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def on_response_complete(self) -> None:
        answered = self.cycle  # a pipelined request may start a new cycle in what follows
        super().on_response_complete()
        self._arm_header_deadline(answered)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        super().connection_lost(exc)

    def _arm_header_deadline(self, answered: object = None) -> None:
        """Close the connection unless a request after `answered` (None: the first) has
        started by the deadline: uvicorn starts a request's cycle once its headers are in."""
        if self._header_timer is not None:
            self._header_timer.cancel()

        def expire() -> None:
            if self.cycle is answered and not self.transport.is_closing():
                self.transport.close()

        self._header_timer = self.loop.call_later(self.header_seconds, expire)


def with_header_deadline(seconds: float) -> type[HeaderDeadline]:
    """`HeaderDeadline` with `seconds` (--client-header-timeout), for uvicorn's `http`."""
    return type("HeaderDeadline", (HeaderDeadline,), {"header_seconds": seconds})
