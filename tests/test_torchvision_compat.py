"""With torchvision installed (the vision extra) on the CPU build of torch, a crosstrain process still imports
transformers' configs and torchvision's pure-Python parts (crosstrain.torchvision_compat)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is None, reason="needs torchvision (the vision extra)")
def test_transformers_and_torchvision_import_after_crosstrain() -> None:
    code = ("import sys, crosstrain; assert 'torch' not in sys.modules\n"
            "from transformers import LlamaConfig\n"
            "from torchvision.transforms import v2\n"
            "import torch; print(v2.RandomHorizontalFlip(p=1.0)(torch.arange(6.0).view(1, 2, 3)).flatten().tolist())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[2.0, 1.0, 0.0, 5.0, 4.0, 3.0]"
