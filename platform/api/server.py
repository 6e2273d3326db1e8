"""`loraplex serve`: uvicorn with loraplex's shutdown rules.

SIGTERM (or Ctrl+C): new requests get 503, requests in flight may finish for up to drain_timeout_s,
then connections close, metering is flushed and the process exits 0. A second signal stops at once.
A dead engine (or a model that failed to load) makes the process exit 1, so that a supervisor
restarts it rather than keeping a server that can only answer 503.
"""

from __future__ import annotations

import logging
import signal
import time
from types import FrameType

import uvicorn

from .app import create_app
from .settings import ServerConfig

log = logging.getLogger(__name__)

EXIT_ENGINE_DEAD = 1
_CLOSE_GRACE_S = 5  # after the drain: how long uvicorn waits for connections before closing them


class LoraplexServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain_timeout_s: float):
        super().__init__(config)
        self.drain_timeout_s = drain_timeout_s
        self.drain_deadline: float | None = None
        self.exit_code = 0

    def _state(self):
        app = self.config.loaded_app
        while app is not None and not hasattr(app, "state"):
            app = getattr(app, "app", None)  # through uvicorn's middleware wrappers
        return getattr(getattr(app, "state", None), "loraplex", None) if app is not None else None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded in _captured_signals: uvicorn would re-raise it after shutdown and the process
        # would die by the signal instead of exiting 0.
        state = self._state()
        if self.drain_deadline is not None or state is None:
            if self.should_exit:
                self.force_exit = True
            self.should_exit = True
            return
        log.info("signal %s: draining (new requests get 503; up to %.0f s for those in flight)", sig,
                 self.drain_timeout_s)
        state.draining = True
        self.drain_deadline = time.monotonic() + self.drain_timeout_s

    async def on_tick(self, counter: int) -> bool:
        state = self._state()
        if state is not None and not self.should_exit:
            if state.load_error is not None or (state.engine is not None and not state.engine.alive):
                log.error("the engine is not running (%r); exiting", state.load_error or state.engine.error)
                self.exit_code = EXIT_ENGINE_DEAD
                state.draining = True
                self.should_exit = True
            elif self.drain_deadline is not None:
                if state.in_flight == 0 or time.monotonic() >= self.drain_deadline:
                    if state.in_flight:
                        log.warning("drain timeout: %d requests still in flight are cut", state.in_flight)
                    self.should_exit = True
        return await super().on_tick(counter)


def serve(config: ServerConfig, log_level: str = "info") -> int:
    app = create_app(config)
    uv = uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level, lifespan="on",
                        timeout_graceful_shutdown=_CLOSE_GRACE_S, access_log=False)
    server = LoraplexServer(uv, config.drain_timeout_s)
    server.run()
    if not server.started and server.exit_code == 0:
        return 3  # start-up failed (the log says why)
    return server.exit_code


__all__ = ["serve", "LoraplexServer", "signal"]
