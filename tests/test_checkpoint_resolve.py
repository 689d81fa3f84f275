"""One answer to "what does this path point to" (crosstrain.checkpoint.resolve), on real files: a run trained here,
its checkpoints, the .safetensors file and Hugging Face folder exported from it. Each kind of path resolves to the
right concrete path; every consumer (eval, ``model.init_from``, export, HF export) reads the same weights through
it; bad paths are one-line errors that name the fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from in_process import crosstrain_main

from crosstrain.checkpoint.consolidate import load_consolidated
from crosstrain.checkpoint.manager import CheckpointManager
from crosstrain.checkpoint.resolve import CHECKPOINT, resolve_path, source_kind
from crosstrain.config import load_config
from crosstrain.errors import CheckpointError, ConfigError

SHAPE = ["model.n_layers=1", "model.dim=32", "model.n_heads=2"]
TRAIN = ["train.steps=4", "train.batch_size=4", "train.seq_len=32", "logging.progress=none", "backend=cpu",
         "logging.tensorboard=false", "checkpoint.every=2", "checkpoint.keep_best=true", "eval.every=2",
         "eval.steps=2", "data.val_fraction=0.05", *SHAPE]


def _sets(items: list[str]) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


@pytest.fixture(scope="module")
def w(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run (checkpoints step_2 and step_4, a best pointer), and what export writes from it."""
    w = tmp_path_factory.mktemp("resolve")
    assert crosstrain_main(["train", *_sets(TRAIN), "--run-dir", str(w / "run")]) == 0
    out = w / "m.safetensors"
    assert crosstrain_main(["export", str(w / "run"), "--format", "safetensors", "--out", str(out)]) == 0
    (w / "exported").mkdir()  # what export.safetensors=true writes: <dir>/model.safetensors
    shutil.copyfile(w / "m.safetensors", w / "exported" / "model.safetensors")
    assert crosstrain_main(["export", str(w / "run"), "--format", "hf", "--out", str(w / "hf")]) == 0
    return w


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from crosstrain.plugins.export.loading import load_model

    return {k: v.clone() for k, v in load_model(path).model.state_dict().items()}


def test_each_kind_of_path_resolves_to_its_concrete_path(w: Path) -> None:
    run, ckpts = w / "run", w / "run" / "checkpoints"
    best = (ckpts / "best").read_text().strip()
    assert best in ("step_2", "step_4")
    cases = [  # (path, best, kind, concrete path, run dir, step, verified)
        (run, False, "checkpoint", ckpts / "step_4", run, 4, True),
        (ckpts, False, "checkpoint", ckpts / "step_4", run, 4, True),
        (ckpts / "step_2", False, "checkpoint", ckpts / "step_2", run, 2, False),
        (run, True, "checkpoint", ckpts / best, run, int(best[5:]), True),
        (ckpts, True, "checkpoint", ckpts / best, run, int(best[5:]), True),
        (w / "m.safetensors", False, "safetensors", w / "m.safetensors", None, None, False),
        (w / "exported", False, "safetensors", w / "exported" / "model.safetensors", None, None, False),
        (w / "hf", False, "hf", w / "hf", None, None, False),
    ]
    for path, pick_best, kind, concrete, run_dir, step, verified in cases:
        got = resolve_path(path, best=pick_best)
        assert (got.kind, got.path, got.run_dir, got.step, got.verified) == (kind, concrete, run_dir, step, verified), \
            path
        assert source_kind(path) == kind
        assert resolve_path(got) is got  # a resolved path passes through unchanged
    # a checkpoint copied out of its run: the step comes from its manifest, and there is no run dir
    shutil.copytree(ckpts / "step_2", w / "kept")
    got = resolve_path(w / "kept")
    assert (got.kind, got.path, got.run_dir, got.step) == ("checkpoint", w / "kept", None, 2)
    assert resolve_path(run).info.path == ckpts / "step_4" and resolve_path(run).info.step == 4


def test_every_consumer_reads_the_same_weights_through_the_resolver(w: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from crosstrain.recipes.lm import build_model, crosstrain_weights, init_from_record

    run = w / "run"
    final = load_consolidated(run)  # the newest checkpoint, under its plain GPT names
    assert set(final) and all(torch.equal(final[k], v) for k, v in load_consolidated(run / "checkpoints").items())
    # export (every format): the run dir, its checkpoints/, the step folder, the exported file, the HF folder
    for path in (run, run / "checkpoints", run / "checkpoints" / "step_4", w / "m.safetensors", w / "exported",
                 w / "hf"):
        got = _tensors(path)
        assert all(torch.equal(got[k], final[k]) for k in final), path
    # model.init_from: the same sources give the same starting weights, and summary.json names the one read
    for path in (run, run / "checkpoints" / "step_4", w / "m.safetensors", w / "hf"):
        shape = [] if path == w / "hf" else SHAPE  # an HF folder brings its own shape
        config = load_config(None, [f"model.init_from={path}", "backend=cpu", *shape])
        model = build_model(config)
        state = model.state_dict()
        assert all(torch.equal(state[k], final[k]) for k in final), path
        record = init_from_record(config, model)
        assert record is not None and Path(record["source"]) == resolve_path(path).path.resolve()
    tensors, source = crosstrain_weights(str(run))
    assert source == str((run / "checkpoints" / "step_4").resolve()) and tensors.keys() == final.keys()
    # crosstrain eval and export --best pick the checkpoint the best pointer names
    best = (run / "checkpoints" / "best").read_text().strip()
    capsys.readouterr()
    assert crosstrain_main(["eval", str(run), "--best", "--json"]) == 0
    assert Path(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["checkpoint"]).name == best
    assert crosstrain_main(["eval", str(run / "checkpoints" / "step_2"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 2
    out = w / "best.safetensors"
    assert crosstrain_main(["export", str(run), "--best", "--format", "safetensors", "--out", str(out), "--json"]) == 0
    assert Path(json.loads(capsys.readouterr().out)["source"]).name == best
    assert crosstrain_main(["export", str(run), "--best", "--format", "hf", "--out", str(w / "hf_best"), "--json"]) == 0
    assert Path(json.loads(capsys.readouterr().out)["source"]).name == best


def _corrupt(run: Path) -> None:
    for shard in run.glob("checkpoints/step_*/__0_0.distcp"):
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF  # same size: only the checksum can tell
        shard.write_bytes(bytes(data))


def test_bad_paths_are_one_line_errors_that_name_the_fix(w: Path, tmp_path: Path) -> None:
    run = w / "run"
    (tmp_path / "empty").mkdir()
    (tmp_path / "junk.bin").write_bytes(b"junk")
    (tmp_path / "step_3.tmp").mkdir()
    (tmp_path / "fresh" / "checkpoints").mkdir(parents=True)  # a run that saved nothing yet
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("hi")
    (tmp_path / "no_type").mkdir()
    (tmp_path / "no_type" / "config.json").write_text('{"hidden_size": 64}')
    shutil.copytree(run, tmp_path / "bad")
    _corrupt(tmp_path / "bad")
    shutil.copytree(run, tmp_path / "nobest")
    (tmp_path / "nobest" / "checkpoints" / "best").unlink()
    shutil.copytree(run, tmp_path / "garbled")
    (tmp_path / "garbled" / "checkpoints" / "best").write_bytes(b"\xff\xfe nonsense")
    t = tmp_path
    cases = [  # (path, keywords, error, text the message holds)
        (t / "missing", {}, ConfigError, "does not exist; pass a run dir, its checkpoints/ folder, a step_N folder, "
                                         "a .safetensors file or a Hugging Face model folder"),
        (t / "missing", {"what": "model.init_from"}, ConfigError, "model.init_from '"),
        (t / "missing", {"accept": CHECKPOINT}, ConfigError, "pass a run dir, its checkpoints/ folder or a step_N "
                                                             "folder"),
        (t / "empty", {}, ConfigError, "is empty; pass"),
        (t / "junk.bin", {}, ConfigError, "unsupported file type '.bin'"),
        (t / "step_3.tmp", {}, ConfigError, "save never finished; pass a committed step_N folder or the run dir"),
        (t / "fresh", {}, ConfigError, "holds no checkpoint (step_N folder) yet"),
        (t / "notes", {}, ConfigError, "holds no checkpoint, model.safetensors or Hugging Face config.json"),
        (t / "no_type", {}, ConfigError, "has no model_type, so it is not a Hugging Face model folder"),
        (t / "bad", {}, CheckpointError, "every step_N failed verification"),
        (t / "bad" / "checkpoints", {}, CheckpointError, "--check` says why"),
        (run / "checkpoints" / "step_2", {"best": True}, ConfigError, "is a single checkpoint, and best picks among "
                                                                      "a run's checkpoints; pass the run dir"),
        (w / "m.safetensors", {"best": True}, ConfigError, "pass the run dir"),
        (t / "nobest", {"best": True}, ConfigError, "train with checkpoint.keep_best=true"),
        (t / "garbled", {"best": True}, CheckpointError, "(it is corrupt)"),
        (w / "m.safetensors", {"accept": CHECKPOINT}, ConfigError, "is a .safetensors file, which is not accepted "
                                                                   "here"),
        (w / "hf", {"accept": ("checkpoint", "safetensors")}, ConfigError, "is a Hugging Face model folder"),
        (run, {"accept": ("hf",)}, ConfigError, "is a crosstrain checkpoint, which is not accepted here"),
    ]
    for path, kwargs, error, needle in cases:
        with pytest.raises(error) as caught:
            resolve_path(path, **kwargs)  # type: ignore[arg-type]
        message = str(caught.value)
        assert needle in message and "\n" not in message, (path, kwargs, message)
    # the cheap half refuses the same paths without reading checksums (a corrupt run is still a run)
    with pytest.raises(ConfigError, match="does not exist"):
        source_kind(t / "missing")
    assert source_kind(t / "bad") == "checkpoint"


def test_consumers_report_bad_paths_in_one_line(w: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI surfaces: exit 2 for a path that names nothing readable, 5 for a broken checkpoint."""
    shutil.copytree(w / "run", tmp_path / "bad")
    _corrupt(tmp_path / "bad")
    shutil.copytree(w / "run" / "checkpoints" / "step_2", tmp_path / "kept")  # out of its run: no config.toml
    cases = [
        (["eval", str(tmp_path / "missing")], 2, "does not exist"),
        (["eval", str(w / "m.safetensors")], 2, "is a .safetensors file, which is not accepted here"),
        (["eval", str(tmp_path / "kept")], 2, "lies outside a run's checkpoints/ folder"),
        (["eval", str(tmp_path / "bad")], 5, "every step_N failed verification"),
        (["export", str(tmp_path / "bad"), "--out", str(tmp_path / "o.onnx")], 5, "failed verification"),
        (["export", str(w / "run" / "checkpoints" / "step_2"), "--best"], 2, "pass the run dir"),
        (["train", *_sets(TRAIN), "--set", f"model.init_from={tmp_path / 'missing'}", "--run-dir",
          str(tmp_path / "r")], 2, "model.init_from"),
        (["train", *_sets(TRAIN), "--set", f"checkpoint.resume={w / 'm.safetensors'}", "--run-dir",
          str(tmp_path / "r")], 2, "checkpoint.resume"),
        (["train", *_sets([*TRAIN, "moe.experts=2", f"moe.upcycle_from={tmp_path / 'missing'}"]), "--run-dir",
          str(tmp_path / "r")], 2, "moe.upcycle_from"),
    ]
    for argv, code, needle in cases:
        capsys.readouterr()
        assert crosstrain_main(argv) == code, argv
        err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("crosstrain: error:")]
        assert len(err) == 1 and needle in err[0], (argv, err)
    assert not (tmp_path / "r").exists() and not (tmp_path / "o.onnx").exists()  # refused before anything was made


def test_manager_load_and_consolidate_take_any_checkpoint_path(tmp_path: Path) -> None:
    """Checkpoints written through the real CheckpointManager, read back by a step folder or a folder of them."""
    state = {"w": {"t": torch.arange(6.0)}}
    with CheckpointManager(tmp_path / "checkpoints") as mgr:
        mgr.save(1, state)
        state["w"]["t"] += 1
        mgr.save(3, state)
    (tmp_path / "config.toml").write_text("")
    for path, step in ((tmp_path, 3), (tmp_path / "checkpoints", 3), (tmp_path / "checkpoints" / "step_1", 1)):
        target = {"w": {"t": torch.zeros(6)}}
        assert CheckpointManager(tmp_path / "checkpoints").load(path, target) == step
        assert torch.equal(target["w"]["t"], torch.arange(6.0) + (step > 1))
        assert resolve_path(path).run_dir == tmp_path
