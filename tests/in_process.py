"""Shared by tests whose single-process runs need no interpreter of their own: run a ``crosstrain`` command line
in this process, on one thread as a launched worker with ``OMP_NUM_THREADS=1`` does (the same numbers, without
the ~3 s of importing torch and crosstrain again)."""

from __future__ import annotations

import torch


def crosstrain_main(argv: list[str]) -> int:
    """``crosstrain ARGV...`` in this process: its exit code (what ``python -m crosstrain`` would exit with)."""
    from crosstrain.cli.main import main

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return main(argv)
    except SystemExit as exc:  # argparse, and the errors that must not be caught as an Exception
        return exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    finally:
        torch.set_num_threads(threads)
