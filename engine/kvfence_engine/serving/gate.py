"""Authentication before any work: a route's check of the caller, on the headers alone, runs
before one byte of its body is read (issue 33, finding 2).

FastAPI reads and parses a route's body before it solves the route's dependencies, so a check
written as a dependency runs after the work it should have prevented: a body of 200,000
invalid messages was parsed and validated for a caller with no key. `checked_first(check)` is
a route class whose routes call `check(request)` first; only when it passes is the body read
(within the cap and the deadline: serving/limits.py) and parsed as the route declares. The
route's OpenAPI description is FastAPI's own, body included.

A refused request's body is not read; the connection's next headers are due within the header
deadline (serving/connections.py), so a client that keeps sending it is cut off there.
"""

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

Check = Callable[[Request], object]


def checked_first(check: Check) -> type[APIRoute]:
    """A route class whose routes run `check(request)` (raising an EngineError to refuse)
    before their body is read."""

    class CheckedFirst(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()

            async def checked(request: Request) -> Response:
                check(request)
                return await handler(request)

            return checked

    return CheckedFirst
