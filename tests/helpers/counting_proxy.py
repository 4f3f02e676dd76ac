"""A reverse proxy that records every request a client makes to an API server: the method,
the path and the query, at the API's door. Watches are streamed through as they come."""

import asyncio
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import aiohttp.web

from kvfence_devcluster.loop import BackgroundLoop

HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


@dataclass(frozen=True, slots=True)
class Seen:
    method: str
    path: str
    query: dict[str, str]

    @property
    def watch(self) -> bool:
        return self.query.get("watch") in ("true", "1")


@dataclass
class CountingProxy:
    upstream: str
    seen: list[Seen] = field(default_factory=list)
    url: str = ""
    _loop: BackgroundLoop | None = None
    _runner: aiohttp.web.AppRunner | None = None
    _session: aiohttp.ClientSession | None = None

    def start(self) -> "CountingProxy":
        self._loop = BackgroundLoop("counting-proxy").start()
        self._loop.run(self._start())
        return self

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.run(self._stop())
            self._loop.stop()

    async def _start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        app = aiohttp.web.Application()
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = aiohttp.web.AppRunner(app, shutdown_timeout=1.0)
        await self._runner.setup()
        site = aiohttp.web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()
        # the watches' handlers still stream: end them here, not with the loop
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)

    async def _forward(self, request: aiohttp.web.Request) -> Any:
        assert self._session is not None
        self.seen.append(Seen(request.method, request.path, dict(request.query)))
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        body = await request.read()
        async with self._session.request(
            request.method,
            self.upstream + request.path_qs,
            headers=headers,
            data=body or None,
            allow_redirects=False,
        ) as upstream:
            response = aiohttp.web.StreamResponse(status=upstream.status)
            for key, value in upstream.headers.items():
                if key.lower() not in HOP and key.lower() != "content-encoding":
                    response.headers[key] = value
            await response.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
            except (ConnectionResetError, asyncio.CancelledError, aiohttp.ClientError):
                pass
            await response.write_eof()
            return response
