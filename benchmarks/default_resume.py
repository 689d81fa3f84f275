"""Issue 41's acceptance on the real default: ``crosstrain train`` with no arguments (400 steps, checkpoints every
100 steps and every 10 minutes) killed with SIGKILL at 80% of its steps, then the same command with ``--run-dir``,
against an uninterrupted run. Figures: the step resumed from, the age of that checkpoint when the run was killed,
whether the final ``params_sha256`` equals the uninterrupted run's, and what the default checkpoints cost the
uninterrupted run (saves, seconds held in the loop, bytes on disk).

Last line: JSON ``{"steps", "killed_after_step", "resumed_from", "checkpoint_age_s", "same_params_sha256",
"saves", "save_s", "checkpoint_bytes", "wall_s", "load_1min"}``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from run_kill import sigkill_at_step  # noqa: E402  (the tests' helper: one way to kill at a step)

CMD = [sys.executable, "-m", "crosstrain", "train", "--set", "logging.progress=none"]


def main() -> None:
    env = {**os.environ}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    with tempfile.TemporaryDirectory() as tmp:
        run, whole = Path(tmp) / "run", Path(tmp) / "whole"
        t0 = time.perf_counter()
        subprocess.run([*CMD, "--run-dir", str(whole)], env=env, check=True, capture_output=True, timeout=3600)
        wall = time.perf_counter() - t0
        reference = json.loads((whole / "summary.json").read_text())
        steps = int(reference["steps"])
        sigkill_at_step([*CMD, "--run-dir", str(run)], run, steps * 8 // 10, env, timeout_s=3600)
        killed = time.time()
        killed_after = len((run / "metrics.jsonl").read_text().splitlines())
        newest = max((run / "checkpoints").glob("step_[0-9]*"), key=lambda p: int(p.name[5:]), default=None)
        age = killed - newest.stat().st_mtime if newest is not None else None
        out = subprocess.run([*CMD, "--run-dir", str(run)], env=env, check=True, capture_output=True, text=True,
                             timeout=3600)
        found = re.search(r"resumed from \S+ at step (\d+)", out.stderr)
        done = json.loads((run / "summary.json").read_text())
        events = [json.loads(x) for x in (whole / "events.jsonl").read_text().splitlines()]
        saves = [e for e in events if e.get("event") == "checkpoint"]
        size = sum(f.stat().st_size for f in (whole / "checkpoints").rglob("*") if f.is_file())
    print(json.dumps({
        "steps": steps, "killed_after_step": killed_after, "resumed_from": int(found.group(1)) if found else None,
        "checkpoint_age_s": round(age, 1) if age is not None else None,
        "same_params_sha256": done["params_sha256"] == reference["params_sha256"], "saves": len(saves),
        "save_s": round(sum(e["duration_s"] for e in saves), 3), "checkpoint_bytes": size, "wall_s": round(wall, 1),
        "load_1min": os.getloadavg()[0],
    }))


if __name__ == "__main__":
    main()
