"""The language-model server's model manager: the version being served and, with ``--watch``, the poller of
:class:`~crosstrain.plugins.serve.watch.Watcher` that loads each newer verified checkpoint of the run beside it,
gates it and swaps it in. The scheduler reads ``current`` between decode steps: requests admitted after a swap run
on the new version, sequences already decoding finish on theirs.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from crosstrain.checkpoint.resolve import Resolved
from crosstrain.errors import ConfigError
from crosstrain.plugins.serve.config import ServeOptions
from crosstrain.plugins.serve.versions import Version, load_version
from crosstrain.plugins.serve.watch import Watcher


class ModelManager(Watcher[Version]):
    """Holds the serving :class:`Version`; ``events`` keeps the last loads, swaps and refusals (also printed to
    stderr and passed to ``on_event``)."""

    def __init__(self, options: ServeOptions, workdir: Path, on_event: Any = None) -> None:
        super().__init__(best=options.best, poll_s=options.poll_s, on_event=on_event)
        self.options = options
        self.workdir = workdir
        self._serve_first(load_version(options.source, 1, options.engine, options.max_batch, workdir,
                                       best=options.best))
        if options.watch:
            self.run_dir = self._watched_run_dir()

    def _watched_run_dir(self) -> Path:
        run_dir = _run_dir(Path(self.current.source))
        if run_dir is None:
            raise ConfigError(f"--watch follows a run, but {self.options.source} is not a run dir or one of its "
                              "checkpoints; pass the run dir")
        return run_dir

    def _load(self, resolved: Resolved, number: int) -> Version:
        with _short_gil_slices():
            return load_version(resolved, number, self.options.engine, self.options.max_batch, self.workdir)

    def _gate(self, version: Version) -> dict[str, Any]:
        return version.gate.to_dict()


@contextmanager
def _short_gil_slices(seconds: float = 0.0005) -> Iterator[None]:
    """CPython's GIL switch interval at ``seconds`` (default 5 ms) while a version loads beside the serving one.

    Loading is mostly Python (checkpoint planning, the run config, plugin hooks), and the scheduler thread's decode
    step is many short torch calls, each re-taking the GIL: with 5 ms slices it waits up to 5 ms per call (the
    convoy effect). Measured on the tiny model with 16 rows while versions load in a loop: the slowest of 150
    decode steps 290 ms at 5 ms slices, 24 ms at 0.5 ms (median 0.58 ms either way; 12 ms with no load)."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def _run_dir(checkpoint: Path) -> Path | None:
    return checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else None
