"""``vision.channels_last``: a classify run on NHWC weights and batches trains the losses of the NCHW run (within
fp32 rounding of another convolution algorithm), its conv weights and batches are channels_last in every forward,
its checkpoint loads into a contiguous model with the same values, and ``"auto"`` follows each backend's
``Device.prefers_channels_last``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from in_process import crosstrain_main
from torch import nn

pytest.importorskip("sklearn")
try:  # through the plugin's import, which works on the CPU build of torch (crosstrain.plugins.vision.tv)
    from crosstrain.plugins.vision.tv import torchvision

    torchvision()
except ImportError:
    pytest.skip("needs the vision extra (torchvision, timm)", allow_module_level=True)

#: per forward of the training run: (images are channels_last, every multi-channel conv weight is channels_last)
SEEN: list[tuple[bool, bool]] = []
#: the model the last run trained (the in-process loop's module)
TRAINED: list[nn.Module] = []


class Probe(nn.Module):
    """The default digits CNN (3 input channels), recording the memory format of what each forward sees."""

    def __init__(self) -> None:
        super().__init__()
        from crosstrain.plugins.vision.classify.models import build_classifier

        self.inner = build_classifier("digits_cnn", 10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a 1-channel tensor is both NCHW- and NHWC-contiguous, so only weights with C_in > 1 tell the formats apart
        weights = [p for p in self.inner.parameters() if p.dim() == 4 and p.shape[1] > 1]
        cl = torch.channels_last
        SEEN.append((x.is_contiguous(memory_format=cl) and not x.is_contiguous(),
                     bool(weights) and all(w.is_contiguous(memory_format=cl) and not w.is_contiguous()
                                           for w in weights)))
        return self.inner(x)


def probe(_model_section: object) -> nn.Module:
    TRAINED.append(Probe())
    return TRAINED[-1]


def _run(run: Path, channels_last: str) -> dict:
    SEEN.clear()
    TRAINED.clear()
    argv = ["train", "--recipe", "classify", "--run-dir", str(run)]
    for s in ("logging.progress=none", "backend=cpu", "train.steps=30", "checkpoint.every=30", "eval.every=30",
              "eval.max_batches=2", "vision.channels=3", f"model.import_path={__name__}:probe",
              f"vision.channels_last={channels_last}"):
        argv += ["--set", s]
    assert crosstrain_main(argv) == 0
    return json.loads((run / "summary.json").read_text())


def test_channels_last_trains_the_contiguous_losses_and_saves_plain_weights(tmp_path) -> None:
    from crosstrain.plugins.vision.load import load_image_model

    nhwc = _run(tmp_path / "nhwc", "true")
    assert len(SEEN) >= 30 and all(images and weights for images, weights in SEEN)  # training and eval forwards
    assert nhwc["classify"]["channels_last"] is True
    trained = {k: v.detach().clone() for k, v in TRAINED[0].state_dict().items()}
    loaded = load_image_model(tmp_path / "nhwc")  # the checkpoint into a freshly built (NCHW) model
    assert loaded.params_sha256 == nhwc["params_sha256"]
    for name, tensor in loaded.model.state_dict().items():
        assert tensor.is_contiguous() and torch.equal(tensor, trained[name]), name

    nchw = _run(tmp_path / "nchw", "auto")  # "auto" on the cpu backend: off
    assert all(not images and not weights for images, weights in SEEN)
    assert nchw["classify"]["channels_last"] is False
    # the NHWC convolution sums in another order: measured max rel. difference 1.2e-7 over these 30 steps (21 of
    # them bit-equal); training amplifies fp32 rounding over hundreds of steps (docs/vision.md), not over 30
    assert len(nhwc["losses"]) == len(nchw["losses"]) == 30
    for a, b in zip(nchw["losses"], nhwc["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(a)


def test_auto_follows_each_backends_device_property() -> None:
    from crosstrain.backends.cpu.device import CpuDevice
    from crosstrain.backends.cuda.device import CudaDevice
    from crosstrain.backends.npu.device import NpuDevice
    from crosstrain.backends.rocm.device import RocmDevice
    from crosstrain.backends.simdev.device import SimdevDevice
    from crosstrain.plugins.vision.layout import use_channels_last

    expected = {CpuDevice: False, CudaDevice: True, RocmDevice: False, NpuDevice: False, SimdevDevice: False}
    for cls, prefers in expected.items():
        assert cls.prefers_channels_last is prefers, cls.__name__
        assert use_channels_last("auto", cls()) is prefers, cls.__name__
        assert use_channels_last(True, cls()) is True and use_channels_last(False, cls()) is False

