"""The code in docs/recipes.md runs as printed: its recipe blocks are executed and trained for a few steps, and
the batch shapes the doc states (``[B, T]``, packing included) are the ones a recipe receives."""

from __future__ import annotations

import dataclasses
import json
import re
import types
from pathlib import Path

import pytest
import torch
from pydantic import BaseModel

from crosstrain import hookimpl
from crosstrain.config import load_config
from crosstrain.engine import Trainer
from crosstrain.recipes.lm import LMRecipe

DOC = Path(__file__).resolve().parents[1] / "docs" / "recipes.md"
RUN = [
    "train.steps=2",
    "train.batch_size=4",
    "train.seq_len=32",
    "logging.progress=none",
    "eval.every=0",
    "backend=cpu",
]
SMALL = ["model.dim=32", "model.n_layers=1", "model.n_heads=2"]  # a model smaller than the tiny preset


def doc_block(header: str) -> types.ModuleType:
    """The python block of docs/recipes.md whose first line starts with ``header``, executed as a module."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    found = [b for b in blocks if b.startswith(header)]
    assert len(found) == 1, f"docs/recipes.md has {len(found)} python blocks starting with {header!r}"
    module = types.ModuleType(header.strip("# ").split()[0].replace("/", "_").replace(".py", ""))
    exec(compile(found[0], str(DOC), "exec"), module.__dict__)
    return module


class LMKLSection(BaseModel):
    beta: float = 0.1


class LMKLSectionPlugin:
    @hookimpl
    def crosstrain_config_sections(self) -> dict[str, type]:
        return {"lm_kl": LMKLSection}


def _train(tmp: Path, recipe: object, *overrides: str) -> dict:
    Trainer(load_config(None, [*RUN, *overrides]), run_dir=tmp, recipe=recipe).fit()
    return json.loads((tmp / "summary.json").read_text())


def test_lm_kl_block_trains(plugin, tmp_path: Path) -> None:
    plugin(LMKLSectionPlugin(), "docs-lm-kl-section")
    recipe = doc_block("# crosstrain_recipe_example/recipe.py").LMKLRecipe()
    summary = _train(tmp_path, recipe, *SMALL, "lm_kl.beta=0.5")
    assert summary["recipe"] == "lm_kl" and set(summary["models"]) == {"policy", "reference"}
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"kl"' in x]
    assert lines[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # the reference is the policy's copy at step 0
    assert lines[-1]["loss"] == pytest.approx(lines[-1]["ce"] + 0.5 * lines[-1]["kl"], rel=1e-5)


def test_second_model_block_loads_the_teacher_checkpoint(tmp_path: Path) -> None:
    teacher = tmp_path / "teacher"
    teacher_summary = _train(teacher, None)  # the tiny preset, as DistillRecipe's default preset
    recipe = doc_block("# distill.py").DistillRecipe(str(teacher))
    summary = _train(tmp_path / "student", recipe, *SMALL)  # a student of another shape than its teacher
    frozen = summary["models"]["teacher"]
    assert frozen["trainable"] is False and frozen["source"] == str(teacher)
    # the frozen teacher holds exactly the weights the teacher run ended with
    assert frozen["params_sha256"] == teacher_summary["params_sha256"]
    assert summary["params_sha256"] != teacher_summary["params_sha256"]  # the student is the primary


class ShapeRecipe(LMRecipe):
    """``lm`` that records the shape and dtype of every field of every micro-batch it trains on."""

    def __init__(self) -> None:
        self.seen: list[dict[str, tuple]] = []

    def loss(self, models, batch):  # type: ignore[no-untyped-def]
        values = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
        self.seen.append({name: None if v is None else (tuple(v.shape), v.dtype) for name, v in values.items()})
        return super().loss(models, batch)


@pytest.mark.parametrize("packing", ["concat", "documents"])
def test_token_batch_shapes_are_as_documented(tmp_path: Path, packing: str) -> None:
    recipe = ShapeRecipe()
    _train(tmp_path, recipe, *SMALL, "train.batch_size=8", "train.grad_accum=2", f"data.packing={packing}")
    assert len(recipe.seen) == 2 * 2  # 2 steps x grad_accum micro-batches
    shape = ((8 // 2, 32), torch.int64)  # B = batch_size / (dp x grad_accum), T = seq_len
    for fields in recipe.seen:
        assert fields["inputs"] == fields["targets"] == shape
        if packing == "documents":
            assert fields["document_ids"] == fields["positions"] == shape
        else:
            assert fields["document_ids"] is None and fields["positions"] is None


def test_readme_backend_consequences_auto_takeover_and_per_backend_kernels() -> None:
    """README, "Writing a backend plugin": an installed host-memory backend with a higher priority takes over
    ``auto``, and on its device type only its own kernels apply (the cpu backend's native ones are not used)."""
    from crosstrain import pluginmanager, registry
    from crosstrain.backend import Backend
    from crosstrain.device import TorchModuleDevice
    from crosstrain.kernels import reference
    from crosstrain.kernels import registry as kernels

    class HostDevice(TorchModuleDevice):
        type, dist_backend = "cpu", "gloo"

        def peak_flops(self, dtype: torch.dtype) -> float:
            return 1e12

    class HostBackend(Backend):
        name, priority = "docs-hostchip", 80
        capabilities = frozenset()

        def make_device(self) -> HostDevice:
            return HostDevice()

    class Plugin:
        @hookimpl
        def crosstrain_register_backends(self) -> list[Backend]:
            return [HostBackend()]

    x, w = torch.randn(4, 64), torch.ones(64)
    pluginmanager.register(Plugin(), name="docs-hostchip")
    try:
        registry.reset()
        assert registry.select_backend("auto").backend.name == "docs-hostchip"
        registry.set_active_backend(None)
        assert kernels.resolve("rms_norm", x, w) is reference.rms_norm
        registry.set_active_backend("cpu")  # the cpu backend's own kernels apply again (native where built)
        cpu_impls = [i for i in kernels.impls("rms_norm") if i.backend == "cpu"]
        assert kernels.resolve("rms_norm", x, w) is (cpu_impls[0].fn if cpu_impls else reference.rms_norm)
    finally:
        pluginmanager.unregister("docs-hostchip")
        registry.reset()
