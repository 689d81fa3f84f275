"""Checkpoint library in one process: round trip, atomic layout, corruption fallback, retention, no unpickling."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from crosstrain.checkpoint.app_state import ModelOptimizerState, RankLocal, RNGState
from crosstrain.checkpoint.consolidate import consolidate, load_consolidated
from crosstrain.checkpoint.dcp import CheckpointWarning
from crosstrain.checkpoint.manager import CheckpointManager
from crosstrain.checkpoint.manifest import MANIFEST_FILE, Manifest, sha256_file
from crosstrain.checkpoint.retention import to_delete
from crosstrain.checkpoint.safe_io import SafeFileSystemReader, SafeLoadPlanner, call_dcp, read_metadata
from crosstrain.checkpoint.verify import verify
from crosstrain.errors import CheckpointError, ConfigError
from crosstrain.models.gpt import build_gpt


def _model_opt(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = build_gpt("tiny")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    return model, opt


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> float:
    g = torch.Generator().manual_seed(seed)
    vocab = model.cfg.vocab_size if hasattr(model, "cfg") else 256
    tokens = torch.randint(0, vocab, (2, 17), generator=g)
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.detach())


def _state(model, opt, extra=None):
    return {"train": ModelOptimizerState(model, opt), "rng": RankLocal(RNGState()),
            "extra": extra if extra is not None else {}}


@pytest.mark.parametrize("async_save", [False, True])
def test_round_trip_resumes_exactly(tmp_path: Path, async_save: bool) -> None:
    model, opt = _model_opt()
    _train_step(model, opt, 0)
    mgr = CheckpointManager(tmp_path, async_save=async_save)
    torch.manual_seed(123)
    mgr.save(1, _state(model, opt, {"consumed": 17, "name": "run", "lr": [1e-3, None]}))
    mgr.check_background()
    after = [_train_step(model, opt, s) for s in (1, 2)]
    mgr.close()
    info = mgr.latest()
    assert info is not None and info.step == 1 and info.verified
    assert not list(tmp_path.glob("*.tmp"))
    assert (tmp_path / "latest").read_text().strip() == "step_1"

    model2, opt2 = _model_opt(seed=99)  # different init: everything must come from the checkpoint
    extra: dict = {}
    torch.manual_seed(5)
    mgr2 = CheckpointManager(tmp_path)
    assert mgr2.load(info, _state(model2, opt2, extra)) == 1
    assert extra == {"consumed": 17, "name": "run", "lr": [1e-3, None]}
    assert torch.rand(1).item() == pytest.approx(torch.manual_seed(123) and torch.rand(1).item())
    resumed = [_train_step(model2, opt2, s) for s in (1, 2)]
    assert resumed == after  # bitwise: same layout, same data
    for a, b in zip(model.state_dict().values(), model2.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def _slow_stager(mgr: CheckpointManager, delay_s: float, fail: bool = False) -> None:
    """Make the background part of staging (the ``stage_later`` tensors) start late, or fail."""
    stage = mgr._stager.stage
    main = threading.current_thread()

    def late(tensors: dict) -> dict:
        if threading.current_thread() is not main:
            time.sleep(delay_s)
            if fail:
                raise OSError("staging buffer lost")
        return stage(tensors)

    mgr._stager.stage = late


def test_stage_later_tensors_are_copied_before_fence_returns(tmp_path: Path) -> None:
    weights, counter = torch.arange(1 << 20, dtype=torch.float32), torch.ones(3)
    saved_weights, saved_counter = weights.clone(), counter.clone()
    mgr = CheckpointManager(tmp_path, async_save=True)
    _slow_stager(mgr, 0.3)  # without fence() the in-place update below would land first
    t0 = time.perf_counter()
    mgr.save(1, {"app": {"w": weights}, "other": {"c": counter}}, stage_later=("app",))
    returned_s = time.perf_counter() - t0
    counter.add_(1)  # not in stage_later: staged before save() returned
    mgr.fence()
    weights.mul_(-1)  # the optimizer step
    mgr.close()
    assert returned_s < 0.3  # save() did not wait for the background copy
    out = {"app": {"w": torch.zeros_like(weights)}, "other": {"c": torch.zeros(3)}}
    assert CheckpointManager(tmp_path).load(tmp_path / "step_1", out) == 1
    assert torch.equal(out["app"]["w"], saved_weights) and torch.equal(out["other"]["c"], saved_counter)


def test_failed_background_staging_releases_fence_and_raises(tmp_path: Path) -> None:
    state = {"app": {"w": torch.ones(8)}}
    mgr = CheckpointManager(tmp_path, async_save=True)
    mgr.save(1, state, stage_later=("app",))
    mgr.wait()
    _slow_stager(mgr, 0.05, fail=True)
    mgr.save(2, state, stage_later=("app",))
    mgr.fence()  # returns although staging failed
    with pytest.raises(CheckpointError, match="background save of step 2 failed.*staging buffer lost"):
        mgr.wait()
    mgr.close()
    assert mgr.latest().step == 1 and not (tmp_path / "step_2").exists()


def test_manifest_lists_every_file_with_checksums(tmp_path: Path) -> None:
    model, opt = _model_opt()
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(3, _state(model, opt))
    folder = tmp_path / "step_3"
    manifest = Manifest.read(folder)
    on_disk = {p.name for p in folder.iterdir()} - {MANIFEST_FILE}
    assert set(manifest.files) == on_disk
    for name, entry in manifest.files.items():
        assert sha256_file(folder / name) == entry["sha256"]
        assert (folder / name).stat().st_size == entry["bytes"]
    assert manifest.step == 3 and manifest.world_size == 1


def _flip_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0x01
    path.write_bytes(bytes(data))


def cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> int:
    from crosstrain.cli.main import main

    capsys.readouterr()
    return main(argv)


def test_flipped_byte_is_detected_and_latest_falls_back(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, opt = _model_opt()
    with CheckpointManager(tmp_path, keep_last=3) as mgr:
        mgr.save(1, _state(model, opt))
        ref = {k: v.clone() for k, v in model.state_dict().items()}
        _train_step(model, opt, 0)
        mgr.save(2, _state(model, opt))
    shard = sorted((tmp_path / "step_2").glob("*.distcp"))[0]
    _flip_byte(shard)
    report = verify(tmp_path / "step_2")
    assert not report.ok and shard.name in report.reason and "SHA-256" in report.reason
    with pytest.warns(CheckpointWarning, match=f"step_2.*{shard.name}"):
        info = CheckpointManager(tmp_path).latest()
    assert info is not None and info.step == 1
    model2, opt2 = _model_opt(seed=7)
    CheckpointManager(tmp_path).load(info, _state(model2, opt2))
    for k, v in model2.state_dict().items():
        assert torch.equal(v, ref[k])
    # loading the corrupt one by path refuses
    with pytest.raises(CheckpointError, match="SHA-256"):
        CheckpointManager(tmp_path).load(tmp_path / "step_2", _state(model2, opt2))
    # the CLI agrees
    assert cli(["checkpoint", "verify", str(tmp_path)], capsys) == 1
    out = capsys.readouterr().out
    assert "BAD" in out and "ok   " in out
    # a flipped byte in the manifest itself is caught by its self-checksum
    _flip_byte(tmp_path / "step_1" / MANIFEST_FILE, offset=40)
    assert not verify(tmp_path / "step_1").ok


def test_retention_keep_last_and_keep_every(tmp_path: Path) -> None:
    assert to_delete([1, 2, 3, 4, 5, 6, 7], keep_last=2, keep_every=3) == [1, 2, 4, 5]
    assert to_delete([5], keep_last=1, keep_every=0) == []
    assert to_delete([1, 2, 3], keep_last=0, keep_every=0) == []
    state = {"w": {"t": torch.arange(4.0)}}
    with CheckpointManager(tmp_path, keep_last=2, keep_every=3) as mgr:
        for step in range(1, 8):
            mgr.save(step, state)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_3", "step_6", "step_7"]


def test_consolidate_gives_plain_gpt_state_dict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, opt = _model_opt()
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(4, _state(model, opt))
    full = load_consolidated(tmp_path)
    ref = model.state_dict()
    assert set(full) == set(ref)
    for k in ref:
        assert torch.equal(full[k], ref[k])
    out = tmp_path / "model.safetensors"
    assert cli(["checkpoint", "consolidate", str(tmp_path / "step_4"), "--out", str(out)], capsys) == 0
    from safetensors.torch import load_file

    loaded = load_file(str(out))
    fresh = build_gpt("tiny")
    fresh.load_state_dict(loaded)
    for k in ref:
        assert torch.equal(fresh.state_dict()[k], ref[k])
    consolidate(tmp_path, tmp_path / "again.safetensors")
    assert cli(["checkpoint", "ls", str(tmp_path), "--json"], capsys) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["step"] for r in rows] == [4] and rows[0]["latest"] and rows[0]["ok"]


# -- loading never executes pickled code ---------------------------------------------------------------

class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _reseal(folder: Path) -> None:
    """Rewrite the manifest so the tampered files pass their checksums (an attacker who controls the folder)."""
    manifest = Manifest.read(folder)
    for name in manifest.files:
        manifest.files[name] = {"sha256": sha256_file(folder / name), "bytes": (folder / name).stat().st_size}
    manifest.write(folder)


def test_malicious_pickle_in_any_file_never_runs(tmp_path: Path) -> None:
    model, opt = _model_opt()
    src = tmp_path / "ckpt"
    with CheckpointManager(src) as mgr:
        mgr.save(1, _state(model, opt))
    files = sorted(p.name for p in (src / "step_1").iterdir() if p.name != MANIFEST_FILE)
    assert ".metadata" in files and "meta.json" in files and "rank0.json" in files
    assert any(f.endswith(".distcp") for f in files)
    for i, name in enumerate(files):
        marker = tmp_path / f"pwned{i}"
        folder = tmp_path / f"t{i}" / "step_1"
        folder.parent.mkdir()
        subprocess.run(["cp", "-r", str(src / "step_1"), str(folder)], check=True)
        target = folder / name
        payload = pickle.dumps(_Evil(str(marker)), protocol=2)
        # pad to the original size so every recorded offset/length still lies inside the file
        target.write_bytes(payload + b"\0" * max(0, target.stat().st_size - len(payload)))
        _reseal(folder)
        assert verify(folder).ok  # checksums cannot save us here: the safe reader must
        model2, opt2 = _model_opt(seed=3)
        with pytest.raises(CheckpointError):
            CheckpointManager(folder.parent).load(folder, _state(model2, opt2))
        if name != "rank0.json":  # the only file consolidation does not read
            with pytest.raises(CheckpointError):
                load_consolidated(folder)
        assert not marker.exists(), f"pickled code ran when {name} was replaced"
    # control: the payload is live -- plain pickle would have run it
    control = tmp_path / "control"
    pickle.loads(pickle.dumps(_Evil(str(control))))
    assert control.exists()


def test_pickled_byte_io_entries_are_refused(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    folder = tmp_path / "plain"
    dcp.save({"obj": _Evil(str(marker)), "t": torch.ones(2)}, checkpoint_id=str(folder), no_dist=True)
    md = read_metadata(folder)  # metadata itself is fine to read
    assert "obj" in md.state_dict_metadata
    with pytest.raises(CheckpointError, match="refus"):
        call_dcp("load", dcp.load, {"obj": None, "t": torch.zeros(2)}, storage_reader=SafeFileSystemReader(folder),
                 planner=SafeLoadPlanner(), no_dist=True)
    assert not marker.exists()
    # control: torch's default reader would have executed it
    dcp.load({"obj": None, "t": torch.zeros(2)}, checkpoint_id=str(folder), no_dist=True)
    assert marker.exists()


def test_unknown_entry_and_shape_mismatch_are_clear_errors(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"w": {"t": torch.zeros(3)}})
    mgr = CheckpointManager(tmp_path)
    with pytest.raises(CheckpointError, match="shape mismatch at w.t"):
        mgr.load(mgr.latest(), {"w": {"t": torch.zeros(4)}})
    with pytest.raises(CheckpointError, match="lacks 1 tensors of 'w'"):
        mgr.load(mgr.latest(), {"w": {"t": torch.zeros(3), "u": torch.zeros(1)}})
    with pytest.warns(CheckpointWarning, match="no entry 'other'"):
        mgr.load(mgr.latest(), {"w": {"t": torch.zeros(3)}, "other": {"x": 1}})
    with pytest.raises(ConfigError, match="does not exist"):
        mgr.load(tmp_path / "nope", {})
