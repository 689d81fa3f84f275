"""lm-evaluation-harness in process (``crosstrain eval RUN --tasks``, ``[eval] tasks``) against lm-eval's own
``hf`` model on the ``crosstrain export --format hf`` folder of the same run, and against ``crosstrain generate``.

The tasks are local task YAMLs over JSONL files the test writes (``dataset_path: json``): nothing downloads.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")  # lm-eval's hf model, the reference

from lm_eval_tasks import WORDS, gen_task, mc_task, rolling_task  # noqa: E402
from one_line import one_line_error  # noqa: E402

from crosstrain.cli.main import main  # noqa: E402
from crosstrain.config import load_config  # noqa: E402
from crosstrain.engine import Trainer  # noqa: E402

TRAIN = ["logging.progress=none", "train.steps=40", "train.seq_len=64", "train.batch_size=8", "checkpoint.every=40"]


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("eval_tasks")
    Trainer(load_config(None, [*TRAIN, "eval.every=0"]), run_dir=root / "run").fit()
    mc_task(root)
    rolling_task(root)
    return root


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))


def _ours(work: Path, capsys: pytest.CaptureFixture[str], task: Path, *extra: str) -> dict:
    capsys.readouterr()
    assert main(["eval", str(work / "run"), "--tasks", str(task), "--json", "--log-samples", *extra]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _choice(sample: dict) -> int:
    scores = [r[0] for r in sample["filtered_resps"]]
    return max(range(len(scores)), key=scores.__getitem__)


def test_multiple_choice_scores_equal_lm_eval_hf_on_the_exported_folder(work: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    tasks = f"{work / 'mc.yaml'},{work / 'roll.yaml'}"
    assert main(["eval", str(work / "run"), "--tasks", tasks, "--json", "--log-samples"]) == 0
    ours = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    hf = work / "hf"
    assert main(["export", str(work / "run"), "--format", "hf", "--out", str(hf)]) == 0
    from lm_eval.tasks import TaskManager

    # the byte tokenizer has no EOS: the reference starts empty contexts from byte 0 as the adapter does
    ref = lm_eval.simple_evaluate(model="hf", model_args={"pretrained": str(hf), "dtype": "float32",
                                                          "prefix_token_id": 0, "device": "cpu"},
                                  tasks=[str(work / "mc.yaml"), str(work / "roll.yaml")], batch_size=8,
                                  log_samples=True,
                                  task_manager=TaskManager(include_path=str(work), include_defaults=False))
    assert ours["step"] == 40 and len(ours["samples"]["tiny_mc"]) == 60
    assert ours["scores"]["tiny_mc/acc"] == pytest.approx(ref["results"]["tiny_mc"]["acc,none"], abs=1e-12)
    assert ours["scores"]["tiny_mc/acc_norm"] == pytest.approx(ref["results"]["tiny_mc"]["acc_norm,none"], abs=1e-12)
    mine = {s["doc_id"]: s for s in ours["samples"]["tiny_mc"]}
    theirs = {s["doc_id"]: s for s in ref["samples"]["tiny_mc"]}
    assert sorted(mine) == sorted(theirs) == list(range(60))
    for doc, sample in theirs.items():
        assert _choice(mine[doc]) == _choice(sample), doc
        for (ll, greedy), (ref_ll, ref_greedy) in zip(mine[doc]["filtered_resps"], sample["filtered_resps"],
                                                      strict=True):
            assert ll == pytest.approx(ref_ll, abs=1e-4) and greedy == ref_greedy
    import crosstrain.plugins.evaluate.adapter  # noqa: F401  registers "crosstrain" with lm-eval

    by_name = lm_eval.simple_evaluate(model="crosstrain", model_args=f"path={work / 'run'}",
                                      tasks=[str(work / "mc.yaml")], batch_size=4,
                                      task_manager=TaskManager(include_path=str(work), include_defaults=False))
    assert by_name["results"]["tiny_mc"]["acc,none"] == ours["scores"]["tiny_mc/acc"]
    for metric in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
        assert ours["scores"][f"tiny_roll/{metric}"] == pytest.approx(ref["results"]["tiny_roll"][f"{metric},none"],
                                                                       rel=1e-5)
    rolled = {s["doc_id"]: s for s in ours["samples"]["tiny_roll"]}
    for sample in ref["samples"]["tiny_roll"]:
        assert len(sample["doc"]["text"]) > 256  # more than one window
        assert rolled[sample["doc_id"]]["filtered_resps"][0] == pytest.approx(sample["filtered_resps"][0], rel=1e-5)


def _generated(work: Path, capsys: pytest.CaptureFixture[str], prompt: str) -> str:
    capsys.readouterr()
    assert main(["generate", str(work / "run"), "--prompt", prompt, "--max-new-tokens", "24", "--json"]) == 0
    return str(json.loads(capsys.readouterr().out)["text"])


def test_generate_until_outputs_equal_crosstrain_generate(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the stop string: two characters first seen past the start of the first prompt's greedy text, so that output
    # is cut and keeps something (a 40-step model may repeat one word: " the the the")
    first = _generated(work, capsys, f"The {WORDS[0]} and the")
    until = next(first[k:k + 2] for k in range(2, len(first) - 1) if first.find(first[k:k + 2]) == k)
    ours = _ours(work, capsys, gen_task(work, until), "--limit", "4")
    samples = sorted(ours["samples"]["tiny_gen"], key=lambda s: s["doc_id"])
    assert len(samples) == 4 and "tiny_gen/exact_match" in ours["scores"]
    cut = 0
    for sample in samples:
        context, gen_kwargs = sample["arguments"][0]
        assert gen_kwargs["until"] == [until]
        text = _generated(work, capsys, context)
        assert sample["filtered_resps"] == [text.split(until)[0]]
        cut += len(text.split(until)[0]) < len(text)
    assert cut >= 1 and sample["filtered_resps"][0]


def test_eval_tasks_during_training_go_to_metrics_and_summary(work: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    overrides = [*TRAIN, "train.steps=10", "checkpoint.every=10", "eval.every=5",
                 f"eval.tasks=[{json.dumps(str(work / 'mc.yaml'))}]", "eval.tasks_limit=12"]
    Trainer(load_config(None, overrides), run_dir=run).fit()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    scored = {r["step"]: r for r in records if "eval/tiny_mc/acc" in r}
    assert sorted(scored) == [5, 10]
    for r in scored.values():
        assert r["eval/tiny_mc/acc"] * 12 == pytest.approx(round(r["eval/tiny_mc/acc"] * 12))  # 12 items scored
    summary = json.loads((run / "summary.json").read_text())
    assert summary["eval_tasks"]["tiny_mc/acc"] == scored[10]["eval/tiny_mc/acc"]
    pytest.importorskip("matplotlib")
    from crosstrain.plugins.observability.report import write_report

    page = Path(write_report([run], tmp_path / "report")).read_text()
    assert "panel-eval_tasks" in page and (tmp_path / "report" / "eval_tasks.png").stat().st_size > 1000


def test_scoring_leaves_the_global_generators_as_they_were(work: Path) -> None:
    """lm-eval seeds Python's, numpy's and torch's generators; a training run scored mid-way keeps its streams."""
    import random

    import numpy as np
    import torch

    from crosstrain.plugins.evaluate.adapter import CrosstrainLM
    from crosstrain.plugins.evaluate.tasks import score

    lm = CrosstrainLM.from_run(str(work / "run"))  # building the model draws from torch's generator
    torch.manual_seed(7), np.random.seed(7), random.seed(7)
    found = score(lm, [str(work / "mc.yaml")], limit=3)
    assert set(found.scores) >= {"tiny_mc/acc", "tiny_mc/acc_norm"}
    after = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(7), np.random.seed(7), random.seed(7)
    assert torch.equal(after[0], torch.rand(3)) and (after[1] == np.random.rand(3)).all()
    assert after[2] == random.random()


@pytest.mark.parametrize("tasks, words", [
    ("{root}/nope.yaml", ("nope.yaml", "does not exist")),
    ("no_such_task_xyz", ("no_such_task_xyz", "task YAML")),
])
def test_missing_task_is_one_line_exit_2(work: Path, tasks: str, words: tuple[str, ...],
                                         capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert main(["eval", str(work / "run"), "--tasks", tasks.format(root=work)]) == 2
    out, err = capsys.readouterr()
    line = one_line_error(out, err)[-1]
    assert all(w in line for w in words), line


@pytest.mark.parametrize("args, words", [
    (["--limit", "3"], "apply to --tasks"),
    (["--tasks", "{mc}", "--limit", "0"], "--limit=0 must be >= 1"),
    (["--tasks", "{mc}", "--num-fewshot", "-1"], "--num-fewshot=-1 must be >= 0"),
    (["--tasks", "{mc}", "--nproc", "2"], "drop --nproc"),
    (["--tasks", " , "], "--tasks is empty"),
])
def test_bad_task_options_are_one_line_exit_2(work: Path, args: list[str], words: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert main(["eval", str(work / "run"), *(a.format(mc=work / "mc.yaml") for a in args)]) == 2
    assert words in one_line_error(*capsys.readouterr())[-1]


def test_without_lm_eval_the_line_names_the_extra(work: Path, capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if not installed: find_spec gives None
    capsys.readouterr()
    assert main(["eval", str(work / "run"), "--tasks", str(work / "mc.yaml")]) == 2
    line = one_line_error(*capsys.readouterr())[-1]
    assert "pip install 'crosstrain[eval]'" in line


def test_eval_tasks_on_more_than_one_process_is_refused_before_any_worker(work: Path, tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str],
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    code = main(["train", "--nproc", "2", "--set", "train.steps=2", "--set",
                 f"eval.tasks=[{json.dumps(str(work / 'mc.yaml'))}]"])
    line = one_line_error(*capsys.readouterr(), lines=1)[0]
    assert code == 2 and "eval.tasks are scored in one process, and this run has 2" in line
    assert list(tmp_path.iterdir()) == []  # no worker started, no run dir
