"""The simdev build's lock (backends/simdev/build.py). torch's ``cpp_extension.load`` guards a build folder with a
``lock`` file that its builder deletes when done; a build killed mid-way leaves it, and every later builder waits for
it forever. Under ``build_lock`` (an ``flock``, dropped by the kernel with its holder) such a file is stale and is
removed. Real builds in real processes: a one-function extension (seconds), and the simdev extension's own cache."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from simdev_env import needs_simdev

#: ``locked_load`` (or, with ``plain``, torch's own ``cpp_extension.load``) of a one-function extension
BUILD = textwrap.dedent("""
    import sys
    from torch.utils import cpp_extension
    from crosstrain.backends.simdev.build import find_ninja, locked_load

    folder, source, plain = sys.argv[1], sys.argv[2], sys.argv[3] == "plain"
    find_ninja()
    load = cpp_extension.load if plain else locked_load
    print(load(build_directory=folder, name="crosstrain_tiny", sources=[source], is_python_module=False))
""")


def _tiny(tmp_path: Path) -> tuple[Path, Path]:
    source = tmp_path / "tiny.cpp"
    source.write_text('extern "C" int crosstrain_tiny() { return 7; }\n')
    folder = tmp_path / "build"
    folder.mkdir()
    return folder, source


def _build(folder: Path, source: Path, how: str = "locked") -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", BUILD, str(folder), str(source), how], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finished(proc: subprocess.Popen[str], timeout: float = 180) -> str:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-2000:]
    return out.strip().splitlines()[-1]


def test_a_killed_builders_lock_file_does_not_hang_the_next_build(tmp_path) -> None:
    folder, source = _tiny(tmp_path)
    killed = _build(folder, source)
    deadline = time.monotonic() + 120
    while not (folder / "lock").exists() and killed.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    killed.kill()  # mid-build: torch's lock file is there
    killed.communicate()
    assert (folder / "lock").exists()
    plain = _build(folder, source, "plain")
    with pytest.raises(subprocess.TimeoutExpired):  # torch alone waits on it for good
        plain.communicate(timeout=5)
    plain.kill()
    plain.communicate()
    library = _finished(_build(folder, source))
    assert Path(library).is_file() and Path(library).parent == folder
    assert not (folder / "lock").exists()


def test_two_builders_at_once_both_load_the_one_build(tmp_path) -> None:
    folder, source = _tiny(tmp_path)
    procs = [_build(folder, source) for _ in range(2)]
    libraries = {_finished(p) for p in procs}
    assert len(libraries) == 1 and Path(libraries.pop()).is_file()
    assert not (folder / "lock").exists()


@needs_simdev
def test_the_simdev_extension_loads_past_a_stale_lock_in_its_cache() -> None:
    from crosstrain.backends.simdev import build

    folder = Path(build.cache_dir())
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "lock").touch()
    # builds first when this cache is empty (minutes, as the first simdev test would); otherwise a load (seconds)
    done = subprocess.run([sys.executable, "-c", "from crosstrain.backends.simdev import build; build.load()"],
                          capture_output=True, text=True, timeout=900, env=dict(os.environ))
    assert done.returncode == 0, done.stderr[-2000:]
    assert not (folder / "lock").exists()
