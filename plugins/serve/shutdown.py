"""Graceful shutdown: on SIGTERM/SIGINT stop accepting, let the replies in flight finish for ``--shutdown-grace-s``,
then end the rest cleanly (an error event and ``data: [DONE]`` for a stream, a 503 body otherwise), and return so
the server's cleanup runs and the process exits 0.

uvicorn alone re-raises the signal once it has stopped (so ``finally`` blocks never run and the exit status is
-15) and cancels what is still running after its own timeout, cutting streams without ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Callable, Generator
from types import FrameType
from typing import Any

import uvicorn

from crosstrain.plugins.serve.requests import Job

#: SIGINT twice forces an exit (uvicorn's convention); SIGTERM and the first SIGINT drain
SIGNALS = (signal.SIGINT, signal.SIGTERM)

#: after the grace period ends the replies, how long uvicorn may take to send their last events before it cancels
FLUSH_S = 10.0


class InFlight:
    """The jobs whose replies are still being sent (touched on the event loop only): what a shutdown ends."""

    def __init__(self) -> None:
        self._jobs: set[Job] = set()
        self.closed: str | None = None  # the message new jobs are failed with once the grace period is over
        self.at_shutdown = 0  # jobs in flight when the shutdown began
        self.ended = 0  # of those, ended by the grace period running out

    def admit(self, job: Job) -> bool:
        """Track ``job``; False (and the job failed) once the server has ended its replies."""
        if self.closed is not None:
            job.fail(503, self.closed)
            return False
        self._jobs.add(job)
        return True

    def discard(self, job: Job) -> None:
        self._jobs.discard(job)

    def __len__(self) -> int:
        return len(self._jobs)

    def end_all(self, message: str) -> None:
        """Fail every job in flight with ``message`` (503); the scheduler frees their rows at its next step."""
        self.closed = message
        for job in list(self._jobs):
            self.ended += job.finish_reason is None  # one that just finished still sends its own last chunk first
            job.cancelled = True
            job.fail(503, message)
        self._jobs.clear()


class GracefulServer(uvicorn.Server):
    """uvicorn's server, draining on a signal instead of re-raising it. ``on_started`` runs once it accepts."""

    def __init__(self, config: uvicorn.Config, inflight: InFlight, grace_s: float,
                 on_started: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self.inflight = inflight
        self.grace_s = grace_s
        self.on_started = on_started
        self.signal: str | None = None

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.on_started is not None and not self.should_exit:
            self.on_started()

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
            yield
            return
        before = {sig: signal.signal(sig, self.handle_exit) for sig in SIGNALS}
        try:
            yield
        finally:
            for sig, handler in before.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.signal = self.signal or signal.Signals(sig).name
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: Any = None) -> None:
        """uvicorn's shutdown (stop accepting, close idle connections, wait for replies) with the grace timer."""
        self.inflight.at_shutdown = len(self.inflight)
        message = (f"the server is shutting down: this reply did not finish within the {self.grace_s:g} s grace "
                   "period (--shutdown-grace-s); retry on another server")
        timer = asyncio.get_running_loop().call_later(self.grace_s, self.inflight.end_all, message)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def summary(self) -> str:
        """One line: how the server stopped and what became of the replies in flight."""
        ip = self.inflight
        why = f" on {self.signal}" if self.signal else ""
        return (f"crosstrain serve: stopped{why}; {max(ip.at_shutdown - ip.ended, 0)} of {ip.at_shutdown} replies in "
                f"flight finished, {ip.ended} ended after the {self.grace_s:g} s grace period")
