"""``--profile-steps A:B`` (``observability.profile_steps``): a torch.profiler trace of steps A..B on every rank.

Writes ``<run_dir>/profile/trace.rank<N>.json`` (Chrome trace: chrome://tracing, Perfetto) and
``summary.rank<N>.txt`` (the top ops and the shares), and ``shares.rank<N>.json``. The profiler starts when step
A-1 ends and stops when step B ends, through ``crosstrain_on_step_end`` (no change to the loop).

Shares of the profiled steps' wall time (the sum of their ``step_time_s``): ``data`` and ``optimizer`` from the
loop's timers; ``communication``: the profiler's time in collective ops (device time where the device reports
it, else host time), at most the forward + backward time it happens in; ``compute``: forward + backward less
communication; ``other``: what is left (hooks, host work between the timed parts).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from crosstrain.checkpoint.atomic import atomic_path, atomic_write

_COMM = re.compile(r"nccl|gloo|c10d|all_?reduce|all_?gather|reduce_?scatter|broadcast|all_?to_?all|"
                   r"record_param_comms|hccl|rccl", re.IGNORECASE)


def parse_steps(text: str) -> tuple[int, int]:
    a, b = (int(x) for x in text.split(":"))
    return a, b


def shares(parts: dict[str, float], comm_s: float) -> dict[str, float]:
    """Fractions of ``parts["step_time_s"]``: data, compute, communication, optimizer, other (they sum to 1
    unless the timed parts overlap, which ``other`` < 0 would show, clipped to 0)."""
    wall = parts["step_time_s"]
    fwd_bwd = parts["time_forward_s"] + parts["time_backward_s"]
    comm = min(comm_s, fwd_bwd)
    out = {"data": parts["time_data_s"], "compute": fwd_bwd - comm, "communication": comm,
           "optimizer": parts["time_optimizer_s"]}
    out["other"] = max(0.0, wall - sum(out.values()))
    return {k: v / wall for k, v in out.items()} if wall > 0 else {k: 0.0 for k in out}


class StepProfiler:
    """Started and stopped by the step-end hook; one per process."""

    def __init__(self, first: int, last: int) -> None:
        self.first, self.last = first, last
        self.prof: Any = None
        self.parts = dict.fromkeys(("step_time_s", "time_data_s", "time_forward_s", "time_backward_s",
                                    "time_optimizer_s"), 0.0)

    def step_end(self, context: Any, step: int, metrics: dict[str, float]) -> None:
        if self.prof is None and step == self.first - 1:
            self._start(context)
        elif self.prof is not None and self.first <= step <= self.last:
            for key in self.parts:
                self.parts[key] += float(metrics.get(key, 0.0))
            if step == self.last:
                self._stop(context)

    def _start(self, context: Any) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        # the accelerator's own activity where torch's profiler has one named after the device type
        device_activity = getattr(ProfilerActivity, context.device.type.upper(), None)
        if context.device.type != "cpu" and device_activity is not None:
            activities.append(device_activity)
        self.prof = profile(activities=activities, record_shapes=False)
        self.prof.__enter__()

    def _stop(self, context: Any) -> None:
        prof, self.prof = self.prof, None
        prof.__exit__(None, None, None)
        out = Path(context.run_dir) / "profile"
        out.mkdir(parents=True, exist_ok=True)
        rank = context.rank
        with atomic_path(out / f"trace.rank{rank}.json") as tmp:
            prof.export_chrome_trace(str(tmp))
        averages = prof.key_averages()
        device = any(getattr(e, "self_device_time_total", 0) for e in averages)
        key = "self_device_time_total" if device else "self_cpu_time_total"
        comm_us = sum(getattr(e, key, 0) for e in averages if _COMM.search(e.key))
        result = shares(self.parts, comm_us / 1e6)
        steps = f"{self.first}:{self.last}"
        atomic_write(out / f"shares.rank{rank}.json", json.dumps({"steps": steps, "rank": rank, "shares": result,
                                                                 "seconds": self.parts}, indent=2) + "\n")
        table = averages.table(sort_by=key, row_limit=15)
        lines = [f"crosstrain profile of steps {steps} on rank {rank} ({self.parts['step_time_s']:.3f}s)", "",
                 "share of step time:"]
        lines += [f"  {name:<14} {100 * share:5.1f}%" for name, share in result.items()]
        atomic_write(out / f"summary.rank{rank}.txt", "\n".join([*lines, "", f"top ops by {key}:", table]) + "\n")
        context.emit_event("profile", f"crosstrain: profile of steps {steps} written to {out}" if rank == 0 else "",
                           steps=steps, dir=str(out))
