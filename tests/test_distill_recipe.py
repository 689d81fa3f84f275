"""``--recipe distill`` end to end on tiny models: 1 process vs 2 FSDP2 ranks (rel 1e-4), the offline cache
(``crosstrain distill cache``) giving the online top-k run's losses, a SIGKILLed run resumed to the uninterrupted
params_sha256 and a changed teacher refused on resume, on-policy micro-batches on prompt/completion rows, and the
bad inputs (one line, exit 2, nothing written)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from in_process import crosstrain_main
from one_line import one_line_error
from run_kill import sigkill_after_checkpoint

STUDENT = ["model.dim=32", "model.n_layers=2", "model.n_heads=2", "train.batch_size=4", "train.seq_len=32",
           "eval.batch_size=4", "eval.steps=2", "logging.progress=none", "logging.every=1", "backend=cpu",
           "optim.lr=1e-2", "schedule.warmup_steps=2"]
TEACHER = ["model.dim=48", "model.n_layers=2", "model.n_heads=4", "train.batch_size=4", "train.seq_len=32",
           "eval.every=0", "logging.progress=none", "backend=cpu", "optim.lr=1e-2", "train.steps=4"]
KD = ["distill.loss=jsd", "distill.beta=0.3", "distill.loss_temperature=2", "distill.top_k_logits=16",
      "distill.alpha=0.5"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    return dict(env, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _argv(run_dir: Path, *sets: str, recipe: str = "distill") -> list[str]:
    argv = ["train", "--recipe", recipe, "--run-dir", str(run_dir)]
    for s in sets:
        argv += ["--set", s]
    return argv


def _train(run_dir: Path, *sets: str, nproc: int = 1) -> dict:
    argv = _argv(run_dir, *STUDENT, *sets)
    if nproc > 1:
        proc = subprocess.run([sys.executable, "-m", "crosstrain", *argv, "--nproc", str(nproc)], capture_output=True,
                              text=True, env=_env(), timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    else:
        assert crosstrain_main(argv) == 0
    return json.loads((run_dir / "summary.json").read_text())


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("distill") / "teacher"
    assert crosstrain_main(_argv(run, *TEACHER, recipe="lm")) == 0  # wider than the student: another size
    return run


def test_two_ranks_equal_one_and_the_cache_equals_the_online_teacher(teacher, tmp_path, capsys) -> None:
    sets = (f"distill.teacher={teacher}", *KD, "train.steps=4", "eval.every=2", "export.safetensors=true")
    one = _train(tmp_path / "one", *sets)
    record = one["distill"]["teacher"]
    assert record["source"].endswith("step_4") and record["sha256"] == one["models"]["teacher"]["params_sha256"]
    assert one["models"]["teacher"]["trainable"] is False
    rows = _metrics(tmp_path / "one")
    assert {"kd", "nll/student", "on_policy"} <= set(rows[0])
    evals = [r for r in rows if "eval/loss" in r]
    assert len(evals) == 2 and {"eval/kd", "eval/nll/student", "eval/nll/teacher"} <= set(evals[0])
    assert evals[0]["eval/nll/teacher"] == evals[1]["eval/nll/teacher"]  # frozen: the teacher does not move
    assert evals[1]["eval/nll/student"] < evals[0]["eval/nll/student"]

    two = _train(tmp_path / "two", *sets, "parallel.dp_shard=2", nproc=2)
    assert two["mesh"]["dp_shard"] == 2
    for a, b in zip(one["losses"], two["losses"], strict=True):
        assert abs(a - b) <= 1e-4 * abs(a)
    for ma, mb in zip(evals, [r for r in _metrics(tmp_path / "two") if "eval/loss" in r], strict=True):
        for key in ("eval/loss", "eval/kd", "eval/nll/teacher"):
            assert mb[key] == pytest.approx(ma[key], rel=1e-4)

    cache = tmp_path / "teacher_top16.safetensors"
    argv = ["distill", "cache", str(teacher), "--out", str(cache), "--top-k", "16"]
    for s in (*STUDENT, *KD):
        argv += ["--set", s]
    capsys.readouterr()
    assert crosstrain_main(argv) == 0
    progress = [line for line in capsys.readouterr().err.splitlines() if line.startswith("crosstrain: distill cache:")]
    for split in ("train", "eval"):  # each split's start and end, whatever the machine's speed between them
        assert any(re.fullmatch(rf"crosstrain: distill cache: {split}: 0/\d+ samples", x) for x in progress), progress
        assert any(re.fullmatch(rf"crosstrain: distill cache: {split}: (\d+)/\1 samples \(100%\), [\d.]+ s, done", x)
                   for x in progress), progress
    # beside distill.cache, distill.teacher names whose output the cache must hold: this one's, so it runs
    cached = _train(tmp_path / "cached", *sets, f"distill.cache={cache}")
    assert "teacher" not in cached.get("models", {})  # no teacher model in memory
    assert cached["distill"]["teacher"]["sha256"] == record["sha256"]
    for a, b in zip(one["losses"], cached["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(a)
    cached_evals = [r for r in _metrics(tmp_path / "cached") if "eval/loss" in r]
    assert cached_evals[0]["eval/nll/teacher"] == pytest.approx(evals[0]["eval/nll/teacher"], rel=1e-5)


def test_killed_run_resumes_exactly_and_a_changed_teacher_is_refused(teacher, tmp_path, capsys) -> None:
    import shutil

    teacher = Path(shutil.copytree(teacher, tmp_path / "teacher"))  # trained on below: the others keep theirs
    sets = (f"distill.teacher={teacher}", "train.steps=8", "checkpoint.every=2", "eval.every=0")
    ref = _train(tmp_path / "ref", *sets)
    run = tmp_path / "killed"
    cmd = [sys.executable, "-m", "crosstrain", *_argv(run, *STUDENT, *sets)]
    sigkill_after_checkpoint(cmd, run, 4, _env(), timeout_s=600)  # bounds a failure only
    resumed = _train(run, *sets)
    assert resumed["steps"] == 8 and resumed["steps_this_run"] < 8
    assert resumed["params_sha256"] == ref["params_sha256"]

    assert crosstrain_main(_argv(teacher, *TEACHER, "train.steps=5", recipe="lm")) == 0  # the teacher trains on
    capsys.readouterr()
    code = crosstrain_main(_argv(run, *STUDENT, *sets[:1], "train.steps=10", "checkpoint.every=2", "eval.every=0"))
    out, err = capsys.readouterr()
    assert code != 0
    line = one_line_error(out, err)[-1]
    assert "frozen model 'teacher' differs" in line and "start a new run dir" in line


def test_on_policy_samples_on_prompt_completion_rows(teacher, tmp_path) -> None:
    from crosstrain.plugins.compress.distill.onpolicy import is_on_policy

    summary = _train(tmp_path / "sft", f"distill.teacher={teacher}", "distill.data=sft", "distill.on_policy=0.5",
                     "rlhf.max_length=32", "rlhf.max_prompt_length=24", "train.steps=6", "eval.every=6")
    rows = _metrics(tmp_path / "sft")
    expected = [float(is_on_policy(0.5, 0, step, 0)) for step in range(6)]
    assert [r["on_policy"] for r in rows] == expected and 0 < sum(expected) < 6  # both kinds were drawn
    assert summary["distill"]["sampled_micro_batches"] == sum(expected)
    assert summary["distill"]["data"] == "sft"
    last = rows[-1]
    assert last["eval/nll/teacher"] > 0 and last["eval/nll/student"] > 0


def _bad(tmp_path: Path, capsys, *sets: str) -> str:
    run = tmp_path / "bad"
    capsys.readouterr()
    code = crosstrain_main(_argv(run, *STUDENT, "train.steps=1", *sets))
    out, err = capsys.readouterr()
    assert code == 2, err
    assert not run.exists()  # refused before anything was written
    return one_line_error(out, err)[-1]


def test_bad_inputs_are_one_line_and_write_nothing(teacher, tmp_path, capsys) -> None:
    import torch

    from crosstrain.models.gpt import build_gpt
    from crosstrain.plugins.export.loading import LoadedModel, save_safetensors, tokenizer_metadata

    assert "needs a teacher" in _bad(tmp_path, capsys)
    assert "does not exist" in _bad(tmp_path, capsys, f"distill.teacher={tmp_path / 'nope'}")
    torch.manual_seed(0)
    other = build_gpt("tiny", vocab_size=300)
    file = save_safetensors(LoadedModel(other, other.config, tokenizer_metadata(other.config), "test"),
                            tmp_path / "other_vocab.safetensors")
    assert "vocabulary of 300 tokens but the student has 256" in _bad(tmp_path, capsys, f"distill.teacher={file}")
    for key, value in (("loss_temperature", "0"), ("loss_temperature", "-1"), ("alpha", "1.5"), ("alpha", "-0.1"),
                       ("beta", "2"), ("on_policy", "1.1"), ("loss", "kl")):
        assert f"distill.{key}" in _bad(tmp_path, capsys, f"distill.teacher={teacher}", f"distill.{key}={value}")
    assert "exceeds the vocabulary of 256 tokens" in _bad(tmp_path, capsys, f"distill.teacher={teacher}",
                                                           "distill.top_k_logits=257")
    assert "unset distill.cache" in _bad(tmp_path, capsys, f"distill.cache={file}", "distill.on_policy=0.5")
    assert "not a distillation cache" in _bad(tmp_path, capsys, f"distill.cache={file}")


def test_a_cache_written_by_another_teacher_is_refused(teacher, tmp_path, capsys) -> None:
    """Two real teachers of the same shape (seeds 0 and 1): the cache of one, distill.teacher the other."""
    other = tmp_path / "other"
    assert crosstrain_main(_argv(other, *TEACHER, "train.seed=1", recipe="lm")) == 0
    cache = tmp_path / "top4.safetensors"
    argv = ["distill", "cache", str(teacher), "--out", str(cache), "--top-k", "4"]
    for s in STUDENT:
        argv += ["--set", s]
    assert crosstrain_main(argv) == 0
    before = cache.read_bytes()
    line = _bad(tmp_path, capsys, f"distill.cache={cache}", f"distill.teacher={other}")
    assert f"written by teacher {teacher.resolve()}" in line and f"distill.teacher is {other.resolve()}" in line
    assert f"rebuild the cache with `crosstrain distill cache {other.resolve()}" in line
    assert cache.read_bytes() == before


@pytest.mark.parametrize("layout", [("parallel.dp_shard=1", "parallel.tp=2"), ("parallel.dp_replicate=2",
                                                                           "parallel.dp_shard=1"),
                                    ("parallel.dp_shard=2", "parallel.ep=2", "moe.experts=4")],
                         ids=["tp=2", "dp_replicate=2", "ep=2"])
def test_other_layouts_equal_one_process(teacher, tmp_path, layout) -> None:
    """tp=2 (the student's logits vocabulary-sharded: the chunked divergence on shards), DDP, and an MoE student
    with its experts over ep=2 give the 1-process losses within 1e-4 relative."""
    sets = (f"distill.teacher={teacher}", *KD, "train.steps=4", "eval.every=0")
    moe = tuple(s for s in layout if s.startswith("moe."))
    one = _train(tmp_path / "one", *sets, *moe)
    two = _train(tmp_path / "two", *sets, *layout, nproc=2)
    assert len(two["losses"]) == 4
    for a, b in zip(one["losses"], two["losses"], strict=True):
        assert abs(a - b) <= 1e-4 * abs(a), (one["losses"], two["losses"])
