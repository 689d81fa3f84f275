"""Every bad input gets one line: a catalogue of config, CLI, data, checkpoint and export mistakes.

Each case runs ``crosstrain ...`` in this process through :func:`crosstrain.cli.main.main` (what the console
script runs) and must end with its exit code (non-zero, or the documented 0), no traceback, at most two lines on
stderr (a warning and the error), and every file of the pre-existing run dirs byte for byte as before. A few cases
run as real processes too, and a full disk is a real (user-namespace) tmpfs.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from one_line import one_line_error

from crosstrain.cli.main import main
from crosstrain.runlock import RunDirLock

SMALL = ["--set", "train.batch_size=4", "--set", "train.seq_len=32", "--set", "logging.progress=none",
         "--set", "logging.tensorboard=false"]
ANY = None  # any non-zero exit code

#: (id, argv with {run} {bad} {busy} {w} placeholders, exit code (ANY: non-zero), text the output must contain)
CASES: list[tuple[str, list[str], int | None, str]] = [
    # -- config values (exit 2, checked before anything is built)
    ("steps-0", ["train", "--set", "train.steps=0"], 2, "'train.steps'"),
    ("steps-negative", ["train", "--set", "train.steps=-5"], 2, "greater than or equal to 1"),
    ("batch-0", ["train", "--set", "train.batch_size=0"], 2, "'train.batch_size'"),
    ("seq-len-1", ["train", "--set", "train.seq_len=1"], 2, "'train.seq_len'"),
    ("seq-len-too-long", ["train", "--set", "train.seq_len=100000"], 2, "exceeds the model's max_seq_len"),
    ("grad-accum-indivisible", ["train", "--set", "train.grad_accum=3"], 2, "divisible by train.grad_accum=3"),
    ("threads-negative", ["train", "--set", "train.threads=-1"], 2, "'train.threads'"),
    ("lr-0", ["train", "--set", "optim.lr=0"], 2, "'optim.lr'"),
    ("lr-text", ["train", "--set", "optim.lr=fast"], 2, "'optim.lr'"),
    ("optimizer-unknown", ["train", "--set", "optim.name=lion"], 2, "'adamw' or 'sgd'"),
    ("betas-above-1", ["train", "--set", "optim.betas=[2,3]"], 2, "'optim.betas.0': Input should be less than 1"),
    ("betas-one-value", ["train", "--set", "optim.betas=[0.9]"], 2, "'optim.betas.1'"),
    ("betas-negative", ["train", "--set", "optim.betas=[0.9,-0.1]"], 2, "'optim.betas.1'"),
    ("eps-0", ["train", "--set", "optim.eps=0"], 2, "'optim.eps'"),
    ("weight-decay-negative", ["train", "--set", "optim.weight_decay=-1"], 2, "'optim.weight_decay'"),
    ("schedule-unknown", ["train", "--set", "schedule.name=step"], 2, "'schedule.name'"),
    ("min-lr-ratio-2", ["train", "--set", "schedule.min_lr_ratio=2"], 2, "'schedule.min_lr_ratio'"),
    ("dtype-unknown", ["train", "--set", "precision.dtype=fp8"], 2, "'precision.dtype'"),
    ("tp-0", ["train", "--set", "parallel.tp=0"], 2, "'parallel.tp'"),
    ("pp-exceeds-world", ["train", "--set", "parallel.pp=2"], 2, "does not divide the world size 1"),
    ("dp-exceeds-world", ["train", "--set", "parallel.dp_replicate=2", "--set", "parallel.dp_shard=1"], 2,
     "but the world size is 1"),
    ("activation-checkpoint-bad", ["train", "--set", "parallel.activation_checkpoint=some"], 2,
     "'parallel.activation_checkpoint'"),
    ("preset-unknown", ["train", "--set", "model.preset=huge"], 2, "unknown model.preset 'huge'"),
    ("dim-heads", ["train", "--set", "model.dim=30", "--set", "model.n_heads=4"], 2, "divisible by model.n_heads"),
    ("kv-heads", ["train", "--set", "model.n_kv_heads=3"], 2, "divisible by model.n_kv_heads=3"),
    ("vocab-too-small", ["train", "--set", "model.vocab_size=100"], 2, "too small for the byte-level corpus"),
    ("import-path-form", ["train", "--set", "model.import_path=nocolon"], 2, "must look like 'package.module:name'"),
    ("import-path-missing", ["train", "--set", "model.import_path=no_such_mod_12:build"], 2, "cannot import"),
    ("keep-last-0", ["train", "--set", "checkpoint.keep_last=0"], 2, "'checkpoint.keep_last'"),
    ("max-rollbacks-negative", ["train", "--set", "fault.max_rollbacks=-1"], 2, "'fault.max_rollbacks'"),
    ("progress-unknown", ["train", "--set", "logging.progress=fancy"], 2, "'logging.progress'"),
    ("kernels-mode-unknown", ["train", "--set", "kernels.mode=fast"], 2, "'kernels.mode'"),
    ("unknown-key", ["train", "--set", "train.stepz=3"], 2, "unknown config key 'train.stepz'"),
    ("unknown-section", ["train", "--set", "nosection.key=1"], 2, "unknown config section 'nosection'"),
    ("value-is-not-a-section", ["train", "--set", "train.steps.x=3"], 2, "'train.steps'"),
    ("backend-unknown", ["train", "--set", "backend=tpu"], 3, "unknown backend 'tpu'"),
    ("recipe-unknown", ["train", "--recipe", "nosuch"], 2, "not a known recipe"),
    # -- --set syntax and config files
    ("set-without-value", ["train", "--set", "train"], 2, "must look like section.key=value"),
    ("set-empty-key", ["train", "--set", "=3"], 2, "is not a dotted key"),
    ("set-empty-part", ["train", "--set", "a..b=3"], 2, "is not a dotted key"),
    ("config-missing", ["train", "{w}/missing.toml"], 2, "does not exist"),
    ("config-bad-toml", ["train", "{w}/bad.toml"], 2, "is not valid TOML"),
    ("config-binary", ["train", "{w}/junk.bin"], 2, "is not text"),
    ("config-section-is-a-value", ["train", "{w}/scalar.toml"], 2, "invalid value for 'train'"),
    ("config-unknown-key", ["train", "{w}/heads.toml"], 2, "unknown config key 'model.heads'"),
    # -- command line
    ("nproc-0", ["train", "--nproc", "0"], 2, "--nproc=0 must be >= 1"),
    ("nproc-negative", ["train", "--nproc", "-2"], 2, "--nproc=-2 must be >= 1"),
    ("nproc-text", ["train", "--nproc", "abc"], 2, "invalid int value: 'abc'"),
    ("nnodes-text", ["train", "--nproc", "2", "--nnodes", "x"], 2, "--nnodes='x'"),
    ("max-restarts-negative", ["train", "--nproc", "2", "--max-restarts", "-1"], 2, "--max-restarts=-1"),
    ("nproc-exceeds-tp", ["train", "--nproc", "2", "--set", "parallel.tp=3"], 2, "does not divide the world size 2"),
    ("run-dir-is-a-file", ["train", "--run-dir", "{w}/text.txt"], 2, "is a file; pass a directory"),
    ("run-dir-under-a-file", ["train", "--run-dir", "{w}/text.txt/run", *SMALL], 2, "cannot be created"),
    ("output-dir-is-a-file", ["train", "--set", "train.output_dir={w}/text.txt", *SMALL], 2, "cannot be created"),
    ("nproc-run-dir-under-a-file", ["train", "--nproc", "2", "--run-dir", "{w}/text.txt/run"], 2,
     "cannot be created"),
    ("unknown-command", ["bogus"], 2, "invalid choice: 'bogus'"),
    ("unknown-option", ["kernels", "--bogus"], 2, "unrecognized arguments: --bogus"),
    ("checkpoint-no-action", ["checkpoint"], 2, "the following arguments are required"),
    ("checkpoint-unknown-action", ["checkpoint", "bogus"], 2, "invalid choice: 'bogus'"),
    # -- data
    ("data-path-missing", ["train", "--set", "data.path={w}/missing.bin"], 2, "does not exist"),
    ("data-path-not-tokens", ["train", "--set", "data.path={w}/junk.bin"], 2, "is not a crosstrain token file"),
    ("data-path-too-short", ["train", "--set", "data.path={w}/text.txt"], 2, "is not a crosstrain token file"),
    ("data-info-missing", ["data", "info", "{w}/missing.bin"], 2, "cannot be read"),
    ("data-info-folder", ["data", "info", "{w}"], 2, "cannot be read"),
    ("data-info-not-tokens", ["data", "info", "{w}/junk.bin"], 2, "is not a crosstrain token file"),
    ("data-prepare-input-missing", ["data", "prepare", "{w}/missing.txt", "--out", "{w}/x.bin"], 2, "does not exist"),
    ("data-prepare-out-folder-missing", ["data", "prepare", "--out", "{w}/no/x.bin"], 2, "does not exist"),
    ("data-prepare-workers", ["data", "prepare", "{w}/text.txt", "--out", "{w}/x.bin", "--workers", "-1"], 2,
     "--workers must be >= 0"),
    ("eval-data-missing", ["eval", "{run}", "--data", "{w}/missing.bin"], 2, "cannot be read"),
    # -- the run dirs: resume, re-run, lock
    ("resume-missing", ["train", "--set", "checkpoint.resume={w}/missing"], 2, "does not exist"),
    ("resume-not-a-checkpoint", ["train", "--set", "checkpoint.resume={w}/junk.bin"], 2,
     "unsupported file type '.bin'"),
    ("resume-corrupt", ["train", "--set", "checkpoint.resume={bad}/checkpoints/step_2", "--set",
                        "train.output_dir={w}/runs"], 5, "fails its SHA-256 check"),
    ("resume-other-depth", ["train", "--run-dir", "{run}", "--set", "model.n_layers=3", *SMALL], 5, "lacks"),
    ("resume-other-width", ["train", "--run-dir", "{run}", "--set", "model.dim=96", "--set", "model.n_heads=4",
                            *SMALL], 5, "shape mismatch"),
    ("rerun-finished-run", ["train", "--run-dir", "{run}", "--set", "train.steps=2", *SMALL], 0,
     "already complete at step 2"),
    ("rerun-with-fewer-steps", ["train", "--run-dir", "{run}", "--set", "train.steps=1", *SMALL], 0,
     "raise train.steps"),
    ("run-dir-in-use", ["train", "--run-dir", "{busy}", "--set", "train.steps=4", *SMALL], 6, "in use by another job"),
    # -- checkpoints
    ("verify-missing", ["checkpoint", "verify", "{w}/missing"], 5, "no checkpoint at"),
    ("verify-a-file", ["checkpoint", "verify", "{run}/config.toml"], 1, "not a directory"),
    ("verify-no-checkpoints", ["checkpoint", "verify", "{w}"], 5, "holds no checkpoints"),
    ("verify-corrupt", ["checkpoint", "verify", "{bad}"], 1, "fails its SHA-256 check"),
    ("ls-missing", ["checkpoint", "ls", "{w}/missing"], 5, "is not a run directory"),
    ("ls-corrupt-unchecked", ["checkpoint", "ls", "{bad}"], 0, "unverified"),
    ("ls-corrupt-checked", ["checkpoint", "ls", "{bad}", "--check"], 1, "BAD: __0_0.distcp fails its SHA-256"),
    ("ls-corrupt-json", ["checkpoint", "ls", "{bad}", "--check", "--json"], 1, '"ok": false'),
    ("consolidate-missing", ["checkpoint", "consolidate", "{w}/missing", "--out", "{w}/c.safetensors"], 2,
     "does not exist"),
    ("consolidate-corrupt", ["checkpoint", "consolidate", "{bad}", "--out", "{w}/c.safetensors"], 5,
     "no valid checkpoint"),
    ("eval-missing", ["eval", "{w}/missing"], 2, "does not exist"),
    ("eval-corrupt", ["eval", "{bad}"], 5, "has no valid checkpoint"),
    # -- export and generate
    ("export-missing", ["export", "{w}/missing"], 2, "does not exist"),
    ("export-format-unknown", ["export", "{run}", "--format", "tflite"], 2, "invalid choice: 'tflite'"),
    ("export-out-suffix-st", ["export", "{run}", "--format", "safetensors", "--out", "{w}/o.onnx"], ANY,
     "must end in .safetensors"),
    ("export-out-suffix-onnx", ["export", "{run}", "--format", "onnx", "--out", "{w}/o.safetensors"], ANY,
     "must end in .onnx"),
    ("export-file-type", ["export", "{w}/junk.bin"], ANY, "unsupported file type '.bin'"),
    ("export-bad-safetensors", ["export", "{w}/f.safetensors", "--format", "safetensors", "--out",
                                "{w}/o2.safetensors"], 5, "is not a readable safetensors file"),
    ("export-corrupt", ["export", "{bad}"], 5, "failed verification"),
    ("export-tolerance-negative", ["export", "{run}", "--tolerance", "-1"], ANY, "--tolerance must be >= 0"),
    ("generate-temperature-negative", ["generate", "{run}", "--prompt", "hi", "--temperature", "-1"], ANY,
     "--temperature must be a number >= 0"),
    ("generate-top-p-2", ["generate", "{run}", "--prompt", "hi", "--top-p", "2"], ANY, "--top-p must lie in (0, 1]"),
    ("generate-top-p-0", ["generate", "{run}", "--prompt", "hi", "--top-p", "0"], ANY, "--top-p must lie in (0, 1]"),
    ("generate-top-k-negative", ["generate", "{run}", "--prompt", "hi", "--top-k", "-3"], ANY, "--top-k must be"),
    ("generate-seed-negative", ["generate", "{run}", "--prompt", "hi", "--seed", "-1"], ANY, "--seed must be"),
    ("generate-threads-0", ["generate", "{run}", "--prompt", "hi", "--threads", "0"], ANY, "--threads must be >= 1"),
    ("generate-max-new-negative", ["generate", "{run}", "--prompt", "hi", "--max-new-tokens", "-1"], ANY,
     "--max-new-tokens must be >= 0"),
    ("generate-too-long", ["generate", "{run}", "--prompt", "hi", "--max-new-tokens", "100000"], ANY,
     "exceeds the model's max_seq_len"),
    ("generate-prompt-ids-text", ["generate", "{run}", "--prompt-ids", "1,x"], ANY, "--prompt-ids must be integers"),
    ("generate-prompt-ids-range", ["generate", "{run}", "--prompt-ids", "999999"], ANY, "must lie in [0, 256)"),
    ("generate-no-prompt", ["generate", "{run}"], 2, "one of the arguments --prompt --prompt-ids is required"),
    ("generate-engine-unknown", ["generate", "{run}", "--prompt", "hi", "--engine", "tensorrt"], 2,
     "invalid choice: 'tensorrt'"),
    ("generate-onnx-missing", ["generate", "{w}/missing.onnx", "--prompt", "hi"], ANY, "does not exist"),
    ("generate-onnx-garbage", ["generate", "{w}/f.onnx", "--prompt", "hi"], ANY, "onnxruntime cannot load"),
    ("generate-onnx-with-torch", ["generate", "{w}/f.onnx", "--prompt", "hi", "--engine", "torch"], ANY,
     "is an ONNX file"),
    ("generate-corrupt", ["generate", "{bad}", "--prompt", "hi"], 5, "failed verification"),
]


def snapshot(root: Path) -> dict[str, str]:
    """SHA-256 of every file under ``root`` by relative path (a file added or removed shows too)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory):
    """A finished run, a copy with a corrupt checkpoint, a copy another job holds, and bad files."""
    w = tmp_path_factory.mktemp("bad-inputs")
    assert main(["train", *SMALL, "--set", "train.steps=2", "--set", "backend=cpu", "--run-dir", str(w / "run")]) == 0
    shutil.copytree(w / "run", w / "bad")
    shard = w / "bad" / "checkpoints" / "step_2" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the checksum can tell
    shard.write_bytes(bytes(data))
    shutil.copytree(w / "run", w / "busy")
    (w / "bad.toml").write_text("[train\nsteps=")
    (w / "scalar.toml").write_text("train = 3\n")
    (w / "heads.toml").write_text("[model]\nheads = 4\n")
    (w / "junk.bin").write_bytes(bytes(range(256)) * 4)
    (w / "text.txt").write_text("hello world\n")
    (w / "f.safetensors").write_bytes(b"not safetensors")
    (w / "f.onnx").write_bytes(b"not onnx")
    with RunDirLock(w / "busy"):  # held as another job would hold it
        yield w, {name: snapshot(w / name) for name in ("run", "bad", "busy")}


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse
        code = int(exc.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("name, argv, expected, needle", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_one_line(world, capsys, name, argv, expected, needle) -> None:
    w, runs = world
    args = [a.format(w=w, run=w / "run", bad=w / "bad", busy=w / "busy") for a in argv]
    code, out, err = _run(args, capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in out + err, err
    assert (code != 0) if expected is ANY else (code == expected), (code, err)
    assert len(lines) <= 2, err
    if code != 0 and lines:
        assert lines[-1].startswith("crosstrain: error: "), lines
    assert needle in out + err, (needle, out, err)
    for run, before in runs.items():
        assert snapshot(w / run) == before, f"{name} changed {run}"


def test_catalogue_is_large_enough() -> None:
    assert len(CASES) >= 60 and len({c[0] for c in CASES}) == len(CASES)


def test_real_processes_print_one_line(world) -> None:
    """The console entry point, not just main(): warnings and errors as lines, no traceback, exit codes kept."""
    w, runs = world
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cases = [(["train", "--nproc", "0"], 2), (["train", str(w / "junk.bin")], 2), (["export", str(w / "bad")], 5),
             (["generate", str(w / "run"), "--prompt", "hi", "--top-p", "2"], 6)]
    procs = [(subprocess.Popen([sys.executable, "-m", "crosstrain", *argv], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True), code) for argv, code in cases]
    for proc, code in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == code, err
        one_line_error(out, err)
    for run, before in runs.items():
        assert snapshot(w / run) == before


def _can_mount_tmpfs(folder: Path) -> bool:
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=64k none {folder}"],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


def test_full_disk_is_one_line_with_sizes_and_the_previous_checkpoint_stays_valid(tmp_path) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    if not _can_mount_tmpfs(disk):
        pytest.skip("needs unshare and a tmpfs mount in a user namespace to make a small, really full disk")
    run = disk / "run"
    train = [sys.executable, "-m", "crosstrain", "train", *SMALL, "--set", "train.steps=4", "--set",
             "checkpoint.every=2", "--set", "backend=cpu", "--run-dir", str(run)]
    # a 2.5 MB disk holds one 1.9 MB checkpoint of the tiny GPT, not two; everything is checked before it is gone
    script = (f"mount -t tmpfs -o size=2500k none {disk} && {' '.join(train)} 2>{tmp_path}/err; echo $? >{tmp_path}/rc;"
              f" cat {run}/checkpoints/latest >{tmp_path}/latest; ls -a {run}/checkpoints >{tmp_path}/ls;"
              f" {sys.executable} -m crosstrain checkpoint verify {run} >{tmp_path}/verify")
    subprocess.run(["unshare", "-rm", "sh", "-c", script], check=True, timeout=300,
                   env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")})
    assert (tmp_path / "rc").read_text().strip() == "5", (tmp_path / "err").read_text()
    err = one_line_error("", (tmp_path / "err").read_text(), lines=1)
    assert err[0].startswith(f"crosstrain: error: no space left on device at {run / 'checkpoints'} (needed about ")
    assert " MB free)" in err[0]
    assert (tmp_path / "latest").read_text().strip() == "step_2"
    assert (tmp_path / "ls").read_text().split() == [".", "..", "latest", "step_2"]  # no half-written step_4.tmp
    assert (tmp_path / "verify").read_text().startswith(f"ok   {run / 'checkpoints' / 'step_2'}")
