"""SIGTERM handling: the first signal asks the trainer to finish the step, save and exit 0."""

from __future__ import annotations

import signal
import threading
from typing import Any


class PreemptionWatcher:
    """Sets :attr:`requested` on SIGTERM (a second SIGTERM falls back to the previous handler)."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name = ""
        self._previous: Any = None
        self._installed = False

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        self._previous = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, self._handle)
        self._installed = True

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:  # second signal: stop waiting
            self.uninstall()
            signal.raise_signal(signum)
            return
        self.requested = True
        self.signal_name = signal.Signals(signum).name

    def uninstall(self) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
            self._installed = False
