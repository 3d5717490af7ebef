"""uvicorn serving the OpenAI API (app.py) on the gateway's event loop, beside its gRPC
server: started with it, stopped with it (the gateway owns the signals)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import uvicorn

logger = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield  # SIGTERM is the gateway's: it stops this server as it stops the rest


class HttpServer:
    """An ASGI app served at host:port (port 0: a free one; `port` is then the one bound),
    TLS with `certfile`/`keyfile`."""

    def __init__(self, app, host: str, port: int, *, certfile: str | None = None,
                 keyfile: str | None = None) -> None:
        config = uvicorn.Config(app, host=host, port=port, loop="none", lifespan="off", access_log=False,
                                log_level="warning", ssl_certfile=certfile, ssl_keyfile=keyfile,
                                timeout_graceful_shutdown=1)
        self._server = _Server(config)
        self._task: asyncio.Task | None = None
        self.port = port

    async def start(self) -> None:
        """Listen; raises OSError if the port cannot be bound."""
        self._task = asyncio.create_task(self._server.serve())
        while not self._server.started:
            if self._task.done():
                try:
                    self._task.result()
                except SystemExit:  # uvicorn's way of saying it could not bind
                    pass
                raise OSError(f"could not listen on {self._server.config.host}:{self.port} (--http-port)")
            await asyncio.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(Exception):
            await self._task
