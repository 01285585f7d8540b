"""Notice clients that went away while their request waits or generates.

aiohttp does not cancel a handler when its client disconnects (the default of `run_app`),
and a non-streaming handler writes nothing until the end, so it would never notice. One
watcher task checks the registered requests' connections every `interval` seconds and calls
their callback once when a connection is gone; the handler then cancels its work.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from aiohttp import web


def client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


class DisconnectWatch:
    def __init__(self, interval: float = 0.25):
        self.interval = interval
        self._watched: dict[int, tuple[web.Request, Callable[[], None]]] = {}
        self._task: asyncio.Task | None = None
        self._next = 0

    def watch(self, request: web.Request, on_gone: Callable[[], None]) -> int:
        """Call `on_gone()` once if the client of `request` disconnects; returns a handle for `forget`."""
        self._next += 1
        self._watched[self._next] = (request, on_gone)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
        return self._next

    def forget(self, handle: int) -> None:
        self._watched.pop(handle, None)

    async def _run(self) -> None:
        while self._watched:
            await asyncio.sleep(self.interval)
            for handle, (request, on_gone) in list(self._watched.items()):
                if client_gone(request):
                    self._watched.pop(handle, None)
                    on_gone()

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
