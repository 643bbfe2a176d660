"""ThreadedApp: an aiohttp Application served on 127.0.0.1 by a background thread (for tests)."""

from __future__ import annotations

import asyncio
import threading

from aiohttp import web

from pdserve.metrics import ServerMetrics
from pdserve.net import free_port


class ThreadedApp:
    """Serve ``app`` on a free port while the ``with`` block runs; ``.port`` says where."""

    def __init__(self, app: web.Application):
        self.app, self.port = app, free_port()
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        runner = web.AppRunner(self.app)
        self.loop.run_until_complete(runner.setup())
        self.loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self.ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(runner.cleanup())

    def __enter__(self):
        self.thread.start()
        if not self.ready.wait(10):
            raise RuntimeError(f"test server on port {self.port} did not start within 10 s")
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class MetricsApp(ThreadedApp):
    """A ServerMetrics served on /metrics by aiohttp in a background thread (for tests that scrape a ServerMetrics)."""

    def __init__(self, metrics: ServerMetrics):
        from aiohttp import web

        self.metrics = metrics
        app = web.Application()
        app.router.add_get("/metrics", metrics.aiohttp_handler)
        super().__init__(app)
