"""One atomic writer, and a full disk as one line: on a real 1 MiB tmpfs (ENOSPC; needs root to mount, skipped
otherwise) and under RLIMIT_FSIZE (EFBIG; no root), ``atomic_write``/``atomic_path`` raise ``NoSpaceError``, leave
no temp file and leave the previous version of the file as it was, whatever form the library's error takes (a
plain write, safetensors, torch.save); an appended log (metrics.jsonl) gives the same error and the metrics
hub re-raises it; and end to end
``crosstrain data prepare`` and ``crosstrain distill cache`` exit with NoSpaceError's code, one line, no traceback,
no temp file."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from one_line import one_line_error

from crosstrain.checkpoint.atomic import atomic_path, atomic_write, is_temp
from crosstrain.checkpoint.space import NoSpaceError
from crosstrain.engine.metrics import JsonlSink, MetricsHub

OLD = b"the previous version\n"
BIG = 2 << 20  # twice the tiny disk


@pytest.fixture
def tiny_disk(tmp_path) -> Iterator[Path]:
    """A real 1 MiB file system (tmpfs), unmounted after the test."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a 1 MiB tmpfs (needs root): {mounted.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def _left(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def _write_plain(path: Path) -> None:
    atomic_write(path, os.urandom(BIG))


def _write_safetensors(path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        save_file({"w": torch.randn(BIG // 4)}, str(tmp))


def _write_torch(path: Path) -> None:  # torch's zip writer hides the errno ("file write failed")
    import torch

    with atomic_path(path) as tmp:
        torch.save({"w": torch.randn(BIG // 4)}, str(tmp))


@pytest.mark.parametrize("write", [_write_plain, _write_safetensors, _write_torch], ids=["bytes", "safetensors",
                                                                                        "torch"])
def test_a_full_disk_is_one_line_no_temp_file_and_the_old_file_intact(tiny_disk, write) -> None:
    target = tiny_disk / "out.bin"
    atomic_write(target, OLD)
    with pytest.raises(NoSpaceError) as info:
        write(target)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"no space left on device writing {target} (")
    assert "MB free); free some space there or write to another disk; the previous out.bin is unchanged" in message
    assert float(message.split(" (")[1].split(" MB free")[0]) > 0.9  # stated once the temp file gave its room back
    assert _left(tiny_disk) == ["out.bin"]
    assert target.read_bytes() == OLD
    atomic_write(target, b"fits")  # the failed write freed its room
    assert target.read_bytes() == b"fits" and _left(tiny_disk) == ["out.bin"]


def test_a_file_size_limit_is_named_and_leaves_nothing(tmp_path) -> None:
    """RLIMIT_FSIZE makes write() fail with EFBIG (Python ignores SIGXFSZ): the error names the limit."""
    target = tmp_path / "out.bin"
    code = textwrap.dedent(f"""
        import resource
        from crosstrain.checkpoint.atomic import atomic_write
        from crosstrain.checkpoint.space import NoSpaceError
        atomic_write({str(target)!r}, {OLD!r})
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.RLIM_INFINITY))
        try:
            atomic_write({str(target)!r}, bytes(1 << 20))
        except NoSpaceError as e:
            print(e)
        """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"a file-size limit (ulimit -f, 0.07 MB) stopped writing {target} ("), out.stdout
    assert out.stdout.rstrip().endswith("raise it (ulimit -f unlimited); the previous out.bin is unchanged")
    assert _left(tmp_path) == ["out.bin"] and target.read_bytes() == OLD


def test_any_other_error_removes_the_temp_file_and_passes_unchanged(tmp_path) -> None:
    target = tmp_path / "out.npy"
    atomic_write(target, OLD)
    with pytest.raises(ValueError, match="the caller's own"), atomic_path(target) as tmp:
        assert tmp.parent == tmp_path and tmp.suffix == ".npy" and tmp.name.startswith(".out.") and is_temp(tmp.name)
        tmp.write_bytes(b"half")
        raise ValueError("the caller's own")
    assert _left(tmp_path) == ["out.npy"] and target.read_bytes() == OLD


def test_an_appended_log_on_a_full_disk_is_the_same_error_and_stops_the_hub(tiny_disk) -> None:
    """metrics.jsonl through the run's MetricsHub: the full disk is re-raised, not a sink disabled with a warning."""
    sink = JsonlSink(tiny_disk / "metrics.jsonl")
    hub = MetricsHub([sink])
    metrics = {f"metric/{i}": float(i) for i in range(200)}  # ~5 KB a line
    with pytest.raises(NoSpaceError, match=f"^no space left on device writing {sink.path} "):
        for step in range(1, 1000):
            hub.write(step, metrics)
    assert hub.sinks == [sink]
    try:  # the refused line may still sit in the buffer: closing gives the same error or none
        sink.close()
    except NoSpaceError:
        pass


def _text(folder: Path, lines: int) -> Path:
    """A text file of ``lines`` random 32-hex-digit lines (33 byte tokens each under the byte tokenizer)."""
    text = folder / "corpus.txt"
    text.write_bytes(b"".join(uuid.uuid4().hex.encode() + b"\n" for _ in range(lines)))
    return text


def _refused(code: int, out: str, err: str, target: Path, words: str) -> None:
    """Exit code of NoSpaceError, one line naming ``target``, no traceback, no temp file, the old file intact."""
    assert code == NoSpaceError.exit_code, err
    line = one_line_error(out, err, lines=1)[0]
    assert line.startswith(f"crosstrain: error: {words}") and str(target) in line, line
    assert _left(target.parent) == [target.name] and target.read_bytes() == OLD


def test_data_prepare_on_a_full_disk_is_one_line(tiny_disk, tmp_path) -> None:
    """A real ``crosstrain`` process writing a 2 MB token file to the 1 MiB disk."""
    out = tiny_disk / "data.bin"
    out.write_bytes(OLD)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "-m", "crosstrain", "data", "prepare", str(_text(tmp_path, BIG // 33)),
                           "--out", str(out)], capture_output=True, text=True, timeout=300, env=env)
    _refused(proc.returncode, proc.stdout, proc.stderr, out, "no space left on device writing")


def test_data_prepare_under_a_file_size_limit_is_one_line(tmp_path, capsys) -> None:
    import resource

    from in_process import crosstrain_main

    out = tmp_path / "tokens" / "data.bin"
    out.parent.mkdir()
    out.write_bytes(OLD)
    argv = ["data", "prepare", str(_text(tmp_path, BIG // 33)), "--out", str(out)]
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
    try:
        code = crosstrain_main(argv)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    _refused(code, *capsys.readouterr(), out, "a file-size limit (ulimit -f, 1.05 MB) stopped writing")


MODEL = ["model.dim=32", "model.n_layers=1", "model.n_heads=2", "train.seq_len=64", "backend=cpu"]


def _sets(*sets: str) -> list[str]:
    return [a for s in sets for a in ("--set", s)]


def test_distill_cache_on_a_full_disk_is_one_line(tiny_disk, tmp_path, capsys) -> None:
    """The teacher's top-64 over 150 lines of text is ~2.4 MB: it cannot fit the 1 MiB disk."""
    from in_process import crosstrain_main

    tokens, teacher = tmp_path / "data.bin", tmp_path / "teacher"
    assert crosstrain_main(["data", "prepare", str(_text(tmp_path, 150)), "--out", str(tokens)]) == 0
    assert crosstrain_main(["train", "--recipe", "lm", "--run-dir", str(teacher), *_sets(
        *MODEL, f"data.path={tokens}", "train.batch_size=4", "train.steps=1", "eval.every=0",
        "logging.progress=none")]) == 0
    out = tiny_disk / "cache.safetensors"
    out.write_bytes(OLD)
    capsys.readouterr()
    code = crosstrain_main(["distill", "cache", str(teacher), "--out", str(out), "--top-k", "64", "--data",
                            str(tokens), *_sets(*MODEL)])
    out_text, err = capsys.readouterr()
    progress = "crosstrain: distill cache: "  # its progress lines on stderr; the error is the one line after them
    err = "".join(line for line in err.splitlines(keepends=True) if not line.startswith(progress))
    _refused(code, out_text, err, out, "no space left on device writing")


def test_hf_export_on_a_full_disk_is_one_line_and_leaves_no_temp_folder(tiny_disk, tmp_path, capsys) -> None:
    """``--format hf`` fills a temp folder renamed whole: its ~1.7 MB of weights cannot fit the 1 MiB disk."""
    from in_process import crosstrain_main

    run = tmp_path / "run"
    assert crosstrain_main(["train", "--run-dir", str(run), *_sets(
        "model.dim=128", "model.n_layers=2", "model.n_heads=2", "train.seq_len=32", "backend=cpu",
        "train.batch_size=2", "train.steps=1", "eval.every=0", "logging.progress=none")]) == 0
    capsys.readouterr()
    code = crosstrain_main(["export", str(run), "--format", "hf", "--out", str(tiny_disk / "hf")])
    out, err = capsys.readouterr()
    assert code == NoSpaceError.exit_code, err
    line = one_line_error(out, err, lines=1)[0]
    assert line.startswith(f"crosstrain: error: no space left on device writing {tiny_disk}/"), line
    assert _left(tiny_disk) == []
