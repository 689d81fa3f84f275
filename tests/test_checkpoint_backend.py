"""CheckpointManager (so every trainer checkpoint) writes and reads through the backend's ``checkpointer()``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from crosstrain import registry
from crosstrain.backend import Backend
from crosstrain.backends.cpu.device import CpuDevice
from crosstrain.checkpoint.dcp import DCPCheckpointer
from crosstrain.checkpoint.manager import CheckpointManager
from crosstrain.checkpoint.safe_io import HashingFileSystemWriter, SafeFileSystemReader
from crosstrain.errors import PluginError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # single-process DCP, on purpose
OPENED: list[str] = []


class RecordingWriter(HashingFileSystemWriter):
    def __init__(self, path, **kwargs) -> None:
        OPENED.append(f"write {Path(path).name}")
        super().__init__(path, **kwargs)


class RecordingReader(SafeFileSystemReader):
    def __init__(self, path) -> None:
        OPENED.append(f"read {Path(path).name}")
        super().__init__(path)


class RecordingCheckpointer(DCPCheckpointer):
    writer_factory = RecordingWriter
    reader_factory = RecordingReader


class StorageBackend(Backend):
    name = "storagebox"
    priority = -10
    capabilities = frozenset({"bf16", "fp16"})

    def make_device(self) -> CpuDevice:
        return CpuDevice()

    def checkpointer(self) -> DCPCheckpointer:
        return RecordingCheckpointer()


class FolderCheckpointer:
    """A checkpointer of another shape (files of its own), not a DCPCheckpointer."""

    def save(self, state, path) -> None:
        raise AssertionError("never called: the manager refuses it first")


class LocalOnlyBackend(StorageBackend):
    name = "localbox"

    def checkpointer(self):  # type: ignore[override]
        return FolderCheckpointer()


@pytest.fixture
def storage_plugin(backend_plugin):
    backend_plugin("storage-plugin", StorageBackend(), LocalOnlyBackend())
    OPENED.clear()


@pytest.mark.parametrize("async_save", [False, True])
def test_manager_uses_the_active_backends_checkpointer(storage_plugin, tmp_path: Path, async_save: bool) -> None:
    registry.set_active_backend("storagebox")
    state = {"extra": {"w": torch.arange(6.0), "step": 3}}
    with CheckpointManager(tmp_path, async_save=async_save) as mgr:
        mgr.save(1, state)
        mgr.wait()
        target = {"extra": {"w": torch.zeros(6)}}
        assert mgr.load(mgr.latest(), target) == 1
    assert torch.equal(target["extra"]["w"], torch.arange(6.0)) and target["extra"]["step"] == 3
    assert OPENED == ["write step_1.tmp", "read step_1"]


def test_a_backend_without_a_dcp_checkpointer_is_a_one_line_error(storage_plugin, tmp_path: Path) -> None:
    with pytest.raises(PluginError, match=r"^backend 'localbox': checkpointer\(\) returned a FolderCheckpointer, "
                                          r"but trainer checkpoints need .*DCPCheckpointer; return a subclass[^\n]*$"):
        CheckpointManager(tmp_path, backend=registry.get_backend("localbox"))


def test_the_default_checkpointer_is_the_cores_dcp_format() -> None:
    """Backends that do not override ``checkpointer()`` keep the core's writer and reader, so the same files."""
    ckpt = registry.get_backend("cpu").checkpointer()
    assert type(ckpt) is DCPCheckpointer
    assert ckpt.writer_factory is HashingFileSystemWriter and ckpt.reader_factory is SafeFileSystemReader
