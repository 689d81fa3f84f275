"""``crosstrain distill demo``: the one-command distillation demo on the embedded corpus, no files needed.

Three runs in this process, each in its folder of ``RUN_DIR``, each printing the trainer's progress lines:

1. ``teacher``: ``--recipe lm``, the ``small`` preset;
2. ``baseline``: the ``tiny`` student on the labels alone (``--recipe lm``);
3. ``student``: the same student (same seed, initial weights, batches and steps) with ``--recipe distill`` from the
   teacher.

The result compares the held-out NLL of the three: the distilled student below the baseline is distillation
working (``kd_vs_ce`` < 1, as ``benchmarks/distill.py`` measures it). Rerunning the command reuses the runs that
finished and resumes one that was stopped.

The first SIGTERM or SIGINT stops the running phase after its step (the trainer's own preemption: a checkpoint, one
line naming the command that continues), no later phase starts, and the command exits ``128 + signal`` (143, 130).
"""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from crosstrain.engine import Trainer

#: every phase: sequences of 64 tokens, no checkpoints but the one a stop writes, one evaluation at the end over the
#: same 10 held-out batches, a progress line every 20 steps (about 1 to 20 s apart on a 2-core machine)
COMMON = ["train.seq_len=64", "eval.max_batches=10", "eval.batch_size=16", "checkpoint.every=0",
          "checkpoint.every_minutes=0", "logging.every=20", "logging.tensorboard=false", "parallel.compile=false",
          "optim.lr=3e-3", "schedule.warmup_steps=10"]
TEACHER = ["model.preset=small", "train.batch_size=8"]
#: a small student batch: its labels are noisy at the grammar's choice points, which the teacher's soft targets
#: average out (docs/compress.md, Benchmark: with 16 sequences a step the two students end equal)
STUDENT = ["model.preset=tiny", "train.batch_size=4"]


class StopRequest:
    """The first SIGTERM/SIGINT, recorded, never raised: an exception thrown into whatever runs when the signal comes
    (a checkpoint being written) would turn into that code's own error. The demo acts on it between phases, and a
    phase's trainer after its step (its preemption: it saves and prints one line)."""

    def __init__(self) -> None:
        self.signum = 0
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        self._previous = {s: signal.signal(s, self.record) for s in (signal.SIGTERM, signal.SIGINT)}

    def uninstall(self) -> None:
        """Give the signals back, unless one stopped the demo: then the process is on its way out with ``128 +
        signal``, and a repeated signal during that exit must change nothing rather than kill it (-15). Ignored, not
        recorded: Python's finalisation puts every handler it installed back to the default, but leaves SIG_IGN."""
        for s, handler in self._previous.items():
            signal.signal(s, signal.SIG_IGN if self.signum else handler)
        self._previous = {}

    def record(self, signum: int, frame: Any = None) -> None:
        """A later signal changes nothing: the phase is already finishing its step and saving it."""
        self.signum = self.signum or signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


class _Phase(Trainer):
    """A demo phase: the trainer's preemption for SIGINT too and for a signal that came while it was being built,
    and the demo's command as the resume hint."""

    def __init__(self, config: Any, run_dir: Path, resume: str, stop: StopRequest) -> None:
        super().__init__(config, run_dir=run_dir)
        self._resume, self._stop = resume, stop
        self._previous_sigint: Any = None
        self.announced = False  # the trainer printed its stop line (with :meth:`resume_command`)

    def resume_command(self) -> str:
        self.announced = True  # asked for by the one line a stopped trainer prints
        return self._resume

    def setup(self) -> None:
        super().setup()  # installs the trainer's SIGTERM handler; a second SIGTERM goes back to StopRequest.record
        if self.complete_at is None:
            self._previous_sigint = signal.signal(signal.SIGINT, self._on_sigint)
            if self._stop.signum:  # came while the run was being built: stop after the first step
                self._request_stop(self._stop.name)

    def _on_sigint(self, signum: int, frame: Any) -> None:
        self._stop.record(signum)
        self._request_stop(signal.Signals(signum).name)

    def teardown(self) -> None:
        if self._previous_sigint is not None:
            signal.signal(signal.SIGINT, self._previous_sigint)
            self._previous_sigint = None
        super().teardown()


def _finished(run_dir: Path, steps: int) -> bool:
    """``run_dir`` holds a run that trained all its ``steps`` (not one a signal stopped)."""
    path = run_dir / "summary.json"
    if not path.is_file():
        return False
    summary = json.loads(path.read_text())
    return not summary.get("preempted") and summary.get("steps") == steps


def _last_eval(run_dir: Path) -> dict[str, float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return next((r for r in reversed(rows) if "eval/loss" in r), {})


def run_demo(run_dir: Path, teacher_steps: int, steps: int, extra: list[str], resume: str,
             say: Callable[[str], None] = print) -> dict[str, Any] | int:
    """Train the teacher, the labels-only student and the distilled student (each unless ``RUN_DIR/<phase>`` holds
    it finished); their held-out NLLs, or the exit code ``128 + signal`` when a signal stopped a phase (``resume``:
    the command that continues, printed by the stopped trainer)."""
    from crosstrain.config import load_config

    teacher = run_dir / "teacher"
    student = [*COMMON, *STUDENT, f"train.steps={steps}", f"eval.every={steps}", *extra]
    phases = [
        ("teacher", teacher, [*COMMON, *TEACHER, f"train.steps={teacher_steps}", f"eval.every={teacher_steps}",
                              *extra], teacher_steps),
        ("baseline", run_dir / "baseline", student, steps),
        ("student", run_dir / "student", [*student, "train.recipe=distill", f"distill.teacher={teacher}"], steps),
    ]
    what = {"teacher": "the teacher (--recipe lm)", "baseline": "the student on the labels alone (--recipe lm)",
            "student": "the same student from the teacher (--recipe distill)"}
    stop = StopRequest()
    stop.install()
    try:
        for i, (name, folder, sets, n) in enumerate(phases, 1):
            if _finished(folder, n):
                say(f"crosstrain: distill demo {i}/3: {name}: reusing the finished run in {folder}")
                continue
            if stop.signum:
                break
            say(f"crosstrain: distill demo {i}/3: {name}: training {what[name]} for {n} steps into {folder}")
            trainer = _Phase(load_config(None, sets), folder, resume, stop)
            trainer.fit()
            if trainer.preemption.requested:  # stopped, or the signal came as the phase finished: no next phase
                stop.record(signal.Signals.__members__.get(trainer.preemption.signal_name, signal.SIGTERM))
                if trainer.announced:  # the trainer's one line named the command that continues
                    return 128 + stop.signum
                break
        if stop.signum:
            print(f"crosstrain: {stop.name} received; the distill demo stopped. Continue with: {resume}",
                  file=sys.stderr, flush=True)
            return 128 + stop.signum
    finally:
        stop.uninstall()
    nll = {
        "teacher": _last_eval(teacher).get("eval/loss"),
        "baseline": _last_eval(run_dir / "baseline").get("eval/loss"),
        "student": _last_eval(run_dir / "student").get("eval/nll/student"),
    }
    result = {"teacher": str(teacher), "baseline": str(run_dir / "baseline"), "student": str(run_dir / "student"),
              "eval_nll_teacher": nll["teacher"], "eval_nll_baseline": nll["baseline"],
              "eval_nll_student": nll["student"]}
    if nll["baseline"] and nll["student"]:
        result["kd_vs_ce"] = nll["student"] / nll["baseline"]
    return result
