"""``python -m crosstrain.testing.conformance --backend NAME [--require] [pytest options]``, for tox and CI.

Runs ``pytest --pyargs crosstrain.testing.conformance --backend NAME``, except that a backend unavailable here ends
at once with one line saying why: exit 0 ("skipped"), or with ``--require`` exit 1 ("failed"): use it where the
hardware is known to be present, so a wrong torch build or a driver problem fails instead of skipping. Never a
pass without the tests having run.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m crosstrain.testing.conformance",
                                     description="the backend conformance suite; other options go to pytest")
    parser.add_argument("--backend", required=True, help="the crosstrain backend to test")
    parser.add_argument("--require", action="store_true", help="an unavailable backend fails instead of skipping")
    args, pytest_args = parser.parse_known_args(argv)

    from crosstrain import pluginmanager, registry
    from crosstrain.errors import CrosstrainError

    try:
        backend = registry.get_backend(args.backend)
    except CrosstrainError as exc:
        # an unknown name is usually a plugin that failed to import: say which and why
        errors = "".join(f"; plugin {e.name!r} failed: {e.error}" for e in pluginmanager.load_errors())
        print(f"conformance: error: {exc}{errors}", file=sys.stderr)
        return 2
    avail = backend.availability()
    if not avail:
        verdict = "failed" if args.require else "skipped"
        print(f"conformance {args.backend}: {verdict}, backend unavailable here: {avail.reason}")
        return 1 if args.require else 0
    import pytest

    return int(pytest.main(["--pyargs", "crosstrain.testing.conformance", "--backend", args.backend, *pytest_args]))


if __name__ == "__main__":
    sys.exit(main())
