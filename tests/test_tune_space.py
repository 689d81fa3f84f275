"""The search space and the PBT decisions as pure functions, and every bad input of ``crosstrain tune`` refused in
one line (exit 2) before any study, trial or run dir exists."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

pytest.importorskip("optuna")

from in_process import crosstrain_main  # noqa: E402
from one_line import one_line_error  # noqa: E402

from crosstrain.plugins.tune.pbt import exploit, explore  # noqa: E402
from crosstrain.plugins.tune.space import Param, as_set, parse_param, snap  # noqa: E402


def test_param_contains_grid_and_snap() -> None:
    warmup = parse_param("schedule.warmup_steps", {"low": 0, "high": 40, "step": 10})
    assert warmup.integer and warmup.grid() == [0, 10, 20, 30, 40]
    assert warmup.contains(20) and not warmup.contains(25) and not warmup.contains(50)
    assert snap(warmup, 26.0) == 30 and snap(warmup, -5.0) == 0
    lr = parse_param("optim.lr", {"low": 1e-4, "high": 3e-3, "log": True})
    assert not lr.integer and lr.contains(3e-3) and not lr.contains(4e-3)
    assert snap(lr, 1.0) == 3e-3
    wd = parse_param("optim.weight_decay", {"choices": [0.0, 0.1]})
    assert wd.contains(0.1) and not wd.contains(0.2) and wd.grid() == [0.0, 0.1]
    assert as_set("optim.lr", 3e-3) == "optim.lr=0.003" and as_set("parallel.compile", False) == \
        "parallel.compile=false"


def test_pbt_exploit_pairs_worst_quarter_with_best_and_explore_perturbs() -> None:
    # losses (minimise): best 3, 0, 5, ...; worst 7, 6 -> member 7 copies 3, member 6 copies 0
    values = [0.2, 0.9, 0.5, 0.1, 0.6, 0.3, 0.95, 0.99]
    assert exploit(values, maximize=False) == [(7, 3), (6, 0)]
    assert exploit([1.0, 2.0], maximize=True) == [(0, 1)]  # at least one member, never the whole population
    space = [Param("optim.lr", low=1e-4, high=1e-2, log=True), Param("optim.weight_decay", choices=(0.0, 0.1))]
    rng = random.Random(0)
    for _ in range(20):
        out = explore({"optim.lr": 1e-3, "optim.weight_decay": 0.0}, space, 1.25, rng)
        assert out["optim.lr"] == pytest.approx(1.25e-3) or out["optim.lr"] == pytest.approx(1e-3 / 1.25)
        assert out["optim.weight_decay"] in (0.0, 0.1)


def test_throughput_knobs_keep_the_global_batch() -> None:
    from crosstrain.config import load_config
    from crosstrain.plugins.tune.throughput import knobs

    grid = knobs(load_config(None, ["train.batch_size=8", "backend=cpu"]), nproc=2)
    assert grid == {"train.grad_accum": [1, 2, 4], "parallel.activation_checkpoint": ["none", "full"],
                    "parallel.layout": ["ddp", "fsdp"]}  # 4 rows per rank: micro-batches of 4, 2 or 1 rows
    assert knobs(load_config(None, ["train.batch_size=6", "backend=cpu"]), nproc=None)["train.grad_accum"] == [1, 2]


BAD = [
    ("unknown key", '[space]\n"optim.lrx" = { low = 1e-4, high = 1e-3 }\n', [], "unknown config key 'optim.lrx'"),
    ("empty range", '[space]\n"optim.lr" = { low = 2e-3, high = 1e-3 }\n', [], "range is empty"),
    ("empty choices", '[space]\n"optim.weight_decay" = { choices = [] }\n', [], "choices is empty"),
    ("value the schema refuses", '[space]\n"optim.lr" = { low = -1.0, high = 1e-3 }\n', [], "optim.lr"),
    ("metric no run reports", '[tune]\nmetric = "eval_los"\npruner = "none"\n[space]\n'
     '"optim.lr" = { low = 1e-4, high = 1e-3 }\n', ["eval.every=0"], "eval.every"),
    ("unknown metric", '[tune]\nmetric = "accuracy"\npruner = "none"\n[space]\n'
     '"optim.lr" = { low = 1e-4, high = 1e-3 }\n', [], "not a key any run reports"),
    ("pruner without eval values", '[tune]\nmetric = "final_loss"\n[space]\n"optim.lr" = { low = 1e-4, high = 1e-3 }\n',
     [], "intermediate values"),
    ("unknown [tune] key", '[tune]\nprunr = "median"\n[space]\n"optim.lr" = { low = 1e-4, high = 1e-3 }\n', [],
     "prunr"),
    ("grid without step", '[tune]\nsampler = "grid"\n[space]\n"optim.lr" = { low = 1e-4, high = 1e-3 }\n', [],
     "needs choices or a step"),
]


@pytest.mark.parametrize(("text", "sets", "words"), [case[1:] for case in BAD], ids=[case[0] for case in BAD])
def test_bad_space_is_one_line_exit_2_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        text: str, sets: list[str], words: str) -> None:
    space, out = tmp_path / "space.toml", tmp_path / "out"
    space.write_text(text)
    argv = ["tune", str(space), "--out", str(out), "--trials", "2"]
    for s in sets:
        argv += ["--set", s]
    assert crosstrain_main(argv) == 2
    captured = capsys.readouterr()
    assert words in one_line_error(captured.out, captured.err)[-1]
    assert not out.exists()
