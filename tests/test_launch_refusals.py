"""``crosstrain train --nproc N`` refuses the combinations of crosstrain.config.rules in the launcher: one line on
stderr, exit 2, no worker started (no torchrun banner) and nothing written (no runs/ folder). In-process CLI."""

from __future__ import annotations

import pytest
from in_process import crosstrain_main

CASES = {
    "dpo with pp=2": (["--recipe", "dpo", "--set", "parallel.pp=2"], "does not run under pipeline parallelism"),
    "LoRA with tp=2": (["--recipe", "sft", "--set", "lora.rank=4", "--set", "parallel.tp=2"],
                       "[lora] supports parallel.tp=1"),
    "ep not dividing experts": (["--set", "moe.experts=3", "--set", "parallel.ep=2"],
                                "parallel.ep=2 must divide moe.experts=3"),
    "ep without experts": (["--set", "parallel.ep=2"], "the model has none (moe.experts=0)"),
    "MoE with pp": (["--set", "moe.experts=4", "--set", "parallel.pp=2"], "not supported under pipeline parallelism"),
    "rm with tp=2": (["--recipe", "rm", "--set", "parallel.tp=2"], "which parallel.tp=2 cannot shard"),
    "LoRA with lm": (["--set", "lora.rank=4"], "train.recipe='lm' would ignore it"),
    "grpo with experts over ep": (["--recipe", "grpo", "--set", "moe.experts=4", "--set", "parallel.ep=2"],
                                  "do not run on experts split over parallel.ep=2 ranks"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_launcher_refuses_before_any_worker_starts(name, tmp_path, capsys, monkeypatch):
    args, words = CASES[name]
    monkeypatch.chdir(tmp_path)
    code = crosstrain_main(["train", "--nproc", "2", *args, "--set", "train.steps=2"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("crosstrain: error: ") and words in err, err
    assert list(tmp_path.iterdir()) == []  # no runs/ folder, no run dir
