"""Observability (docs/observability.md) on real 2-rank runs: per-rank metrics, stragglers, the HTML report."""

from __future__ import annotations

import base64
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

import pytest
from in_process import crosstrain_main

from crosstrain.engine.ranks import RankMetricsWriter, StragglerDetector, busy_seconds
from crosstrain.plugins.observability.panels import BUILTIN
from crosstrain.plugins.observability.profiler import shares
from crosstrain.plugins.observability.report import write_report

PLUGINS = Path(__file__).parent / "plugins"  # crosstrain_slowrank: a straggler on demand, by entry point
TINY = ["backend=cpu", "model.n_layers=2", "model.dim=32", "train.seq_len=32", "train.batch_size=4",
        "logging.progress=none", "logging.tensorboard=false", "schedule.warmup_steps=2", "parallel.dp_replicate=2"]


def _sets(items: list[str]) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join([str(PLUGINS), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def train_2_ranks(run_dir: Path, opts: list[str], args: tuple[str, ...] | list[str] = (),
                  **env: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "crosstrain", "train", "--nproc", "2", *_sets([*TINY, *opts]), *args, "--run-dir",
           str(run_dir)]
    return subprocess.run(cmd, env=_env(**env), capture_output=True, text=True, timeout=240)


def events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def slow_run(tmp_path_factory) -> Path:
    """12 steps on 2 ranks with eval, checkpoints, the MLflow sink and a profile of steps 8..10; rank 1 sleeps
    0.2 s at the end of each step from step 2."""
    run_dir = tmp_path_factory.mktemp("obs") / "run"
    proc = train_2_ranks(run_dir, ["train.steps=12", "eval.every=6", "eval.steps=2", "checkpoint.every=6",
                                   "observability.mlflow=true"],
                         ["--profile-steps", "8:10"], CROSSTRAIN_SLOW_RANK="1", CROSSTRAIN_SLOW_S="0.2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def test_every_rank_writes_its_own_metrics(slow_run: Path) -> None:
    for rank in (0, 1):
        records = [json.loads(x) for x in (slow_run / "ranks" / f"metrics.rank{rank}.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == list(range(1, 13))
        assert all(r["rank"] == rank and r["step_time_s"] > 0 and r["peak_memory_bytes"] > 0 for r in records)


def test_straggler_is_reported_with_its_rank(slow_run: Path) -> None:
    stragglers = [e for e in events(slow_run) if e["event"] == "straggler"]
    assert stragglers, events(slow_run)
    assert {e["rank"] for e in stragglers} == {1}
    first = stragglers[0]
    # rank 1 sleeps from step 2, so 5 slow steps in a row (the default) end at step 6; on a loaded machine its
    # first step may be slow as well (5), or one of its steps hidden by a busier rank 0 (later)
    assert first["step"] >= 5 and first["steps"] == 5 and first["ratio"] > 1.5
    assert first["busy_s"] > 0.2 > first["median_s"]


def test_straggler_detector_judges_only_complete_steps(tmp_path: Path) -> None:
    """Rank 0 reads rank 1's file as it grows; a step is judged once every rank has reported it."""
    found: list[tuple[int, dict]] = []
    det = StragglerDetector(tmp_path, 3, lambda step, name, fields: found.append((step, fields)),
                            fraction=0.5, steps=2, min_s=0.01)
    w1, w2 = RankMetricsWriter(tmp_path, 1), RankMetricsWriter(tmp_path, 2)
    for step in (1, 2, 3):
        det.add(0, step, 0.1)
        w1._fh.write(json.dumps({"step": step, "busy_s": 0.1}) + "\n")  # type: ignore[union-attr]
        det.poll()
        assert not found  # rank 2 has not reported yet
    for step in (1, 2, 3):
        w2._fh.write(json.dumps({"step": step, "busy_s": 0.1 if step == 1 else 0.5}) + "\n")  # type: ignore[union-attr]
    det.poll()
    assert [(s, f["rank"], f["steps"]) for s, f in found] == [(3, 2, 2)]
    w1.close(), w2.close(), det.close()


def test_busy_time_leaves_out_what_waits_for_other_ranks() -> None:
    m = {"time_backward_s": 0.3, "time_optimizer_s": 0.1, "time_comm_s": 0.05, "time_forward_s": 0.2}
    assert busy_seconds(1.0, m) == pytest.approx(0.55)
    assert busy_seconds(0.1, m) == 0.0


def test_profile_steps_write_loadable_traces_and_shares(slow_run: Path) -> None:
    for rank in (0, 1):
        trace = json.loads((slow_run / "profile" / f"trace.rank{rank}.json").read_text())
        assert trace["traceEvents"], rank
        shares = json.loads((slow_run / "profile" / f"shares.rank{rank}.json").read_text())
        assert shares["steps"] == "8:10"
        assert sum(shares["shares"].values()) == pytest.approx(1.0, abs=0.05)
        assert shares["shares"]["compute"] > 0 and shares["shares"]["communication"] > 0  # gloo all-reduces
        summary = (slow_run / "profile" / f"summary.rank{rank}.txt").read_text()
        assert "communication" in summary and "aten::" in summary  # the shares and the top ops
    assert any(e["event"] == "profile" for e in events(slow_run))


def test_profile_shares_add_up() -> None:
    parts = {"step_time_s": 1.0, "time_data_s": 0.1, "time_forward_s": 0.3, "time_backward_s": 0.4,
             "time_optimizer_s": 0.1}
    assert shares(parts, 0.2) == pytest.approx({"data": 0.1, "compute": 0.5, "communication": 0.2,
                                                "optimizer": 0.1, "other": 0.1})
    assert shares(parts, 5.0)["communication"] == pytest.approx(0.7)  # never more than forward + backward


# ---------------------------------------------------------------------------------------------- crosstrain report
class _Dom(HTMLParser):
    """The page's panels: ``{id: (data-points, img src)}``."""

    def __init__(self) -> None:
        super().__init__()
        self.panels: dict[str, list] = {}
        self._current: str | None = None

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = dict(attrs)
        if tag == "section" and "panel" in (a.get("class") or ""):
            self._current = a["id"]
            self.panels[a["id"]] = [int(a["data-points"]), None]
        elif tag == "img" and self._current:
            self.panels[self._current][1] = a.get("src")


def _panels(page: str) -> dict[str, list]:
    dom = _Dom()
    dom.feed(page)
    return dom.panels


BUILTIN_PANELS = {f"panel-{p.id}" for p in BUILTIN}


def _report(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """``crosstrain report ARGS`` in this process: its exit code and stderr."""
    capsys.readouterr()
    code = crosstrain_main(["report", *args])
    return code, capsys.readouterr().err


def test_report_shows_every_plot_of_a_2_rank_run(slow_run: Path, tmp_path: Path, capsys) -> None:
    code, err = _report(capsys, str(slow_run), "--out", str(tmp_path / "rep"))
    assert code == 0, err
    page = (tmp_path / "rep" / "report.html").read_text()
    panels = _panels(page)
    assert BUILTIN_PANELS <= set(panels), set(panels)
    for pid in BUILTIN_PANELS:
        points, src = panels[pid]
        assert points > 0, pid  # every plot has data: eval loss, per-rank times, checkpoint durations included
        assert src.startswith("data:image/png;base64,")  # self-contained
        assert base64.b64decode(src.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"
        assert (tmp_path / "rep" / f"{pid[6:]}.png").stat().st_size > 1000
    assert ">straggler<" in page and "finished" in page  # events table


def test_report_overlays_runs_and_adds_plugin_panels(slow_run: Path, tmp_path: Path) -> None:
    """Two run dirs overlay (twice the points); a plugin panel appears once its metrics exist (moe/*/max_load)."""
    other = tmp_path / "other"
    shutil.copytree(slow_run, other)
    lines = (other / "metrics.jsonl").read_text().splitlines()
    with_moe = [json.dumps({**json.loads(x), "moe/0/max_load": 0.5, "moe/1/max_load": 0.7}) for x in lines]
    (other / "metrics.jsonl").write_text("\n".join(with_moe) + "\n")
    single = _panels(Path(write_report([slow_run], tmp_path / "one")).read_text())
    both = _panels(Path(write_report([slow_run, other], tmp_path / "two")).read_text())
    assert "panel-moe_max_load" not in single and both["panel-moe_max_load"][0] == 2 * len(lines)
    assert both["panel-loss"][0] == 2 * single["panel-loss"][0]
    assert both["panel-rank_step_time"][0] == 2 * single["panel-rank_step_time"][0]


def test_report_of_a_run_still_going(slow_run: Path, tmp_path: Path) -> None:
    """No summary.json yet and a half-written last line: the page shows what is there and says it is running."""
    live = tmp_path / "live"
    shutil.copytree(slow_run, live)
    (live / "summary.json").unlink()
    text = (live / "metrics.jsonl").read_text()
    (live / "metrics.jsonl").write_text(text[: len(text) // 2])  # cut inside a record
    page = Path(write_report([live], tmp_path / "rep")).read_text()
    assert "running (no summary.json yet" in page
    assert _panels(page)["panel-loss"][0] > 0


def test_report_of_a_dir_without_metrics_is_one_line_error(tmp_path: Path, capsys) -> None:
    code, err = _report(capsys, str(tmp_path))
    assert code != 0 and "is not a run dir (no metrics.jsonl)" in err
    assert len(err.strip().splitlines()) == 1


def test_report_in_headless_chromium(slow_run: Path, tmp_path: Path) -> None:
    """Chromium renders the page: its DOM has every panel and the screenshot is not blank."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("Debian's chromium is not installed (.ci/run installs it: apt-get install -y chromium)")
    html_path = write_report([slow_run], tmp_path / "rep")
    flags = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1400,2600",
             f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*flags, "--dump-dom", html_path.as_uri()], capture_output=True, text=True, timeout=90)
    panels = _panels(dom.stdout)
    assert BUILTIN_PANELS <= set(panels), dom.stderr[-2000:]
    shot = tmp_path / "shot.png"
    subprocess.run([*flags, f"--screenshot={shot}", html_path.as_uri()], capture_output=True, timeout=90)
    from PIL import Image

    image = Image.open(shot).convert("L")
    histogram = image.histogram()
    white = sum(histogram[250:])
    assert white < 0.97 * image.width * image.height, "screenshot is blank"
    assert sum(1 for count in histogram if count) > 50  # plots: many grey levels, not a flat page


# ------------------------------------------------------------------------------ Prometheus, stalls and hang dumps
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as response:  # a loaded host
        text = response.read().decode()
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
            if line.startswith("crosstrain_") and "{" not in line}


def _wait(what: str, predicate, timeout: float = 300.0):
    """Poll ``predicate`` until it holds; the timeout only bounds how long a real failure takes to report, so it
    covers starting 2 ranks on a loaded 2-core machine."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except OSError:
            value = None
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _rank_pid(agent: int, rank: int) -> int:
    """The worker process of ``rank`` under the launcher ``agent`` (from /proc: its parent and RANK)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if ppid == agent and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    raise AssertionError(f"no rank {rank} worker under pid {agent}")


def test_prometheus_stall_gauge_and_hang_dump_while_a_rank_is_stopped(tmp_path: Path, capsys) -> None:
    """Scrape over 127.0.0.1 during a 2-rank run: the step advances; SIGSTOP on rank 1: the stall gauge rises and
    rank 0 writes its stacks and a ``hang`` event; SIGCONT, then SIGTERM: the run saves and exits 0."""
    port, run_dir = _free_port(), tmp_path / "run"
    cmd = [sys.executable, "-m", "crosstrain", "train", "--nproc", "2",
           *_sets([*TINY, "train.steps=100000", "eval.every=0", "checkpoint.every=0", "fault.collective_timeout_s=60",
                   f"observability.prometheus_port={port}", "observability.hang_dump_s=2"]), "--run-dir", str(run_dir)]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = _wait("the first scraped step", lambda: _scrape(port).get("crosstrain_step", 0) >= 2 and _scrape(port))
        later = _wait("the step to advance", lambda: (m := _scrape(port))["crosstrain_step"] > first["crosstrain_step"]
                      and m)
        assert later["crosstrain_loss"] > 0 and later["crosstrain_tokens_per_second"] > 0
        assert later["crosstrain_mfu"] > 0 and later["crosstrain_peak_memory_bytes"] > 0
        assert later["crosstrain_last_checkpoint_step"] == -1 and later["crosstrain_seconds_since_last_step"] >= 0
        assert math.isnan(later["crosstrain_eval_loss"])  # eval.every=0: never evaluated, so no value
        _wait("a scrape just after a step", lambda: _scrape(port)["crosstrain_seconds_since_last_step"] < 2)
        live, _ = _report(capsys, str(run_dir), "--out", str(tmp_path / "rep"))  # of the run while it goes
        assert live == 0 and "running (no summary.json" in (tmp_path / "rep" / "report.html").read_text()
        rank1 = _rank_pid(proc.pid, 1)
        os.kill(rank1, signal.SIGSTOP)
        try:
            stalled = _wait("the stall gauge", lambda: (m := _scrape(port))["crosstrain_seconds_since_last_step"] > 3
                            and m)
            dump = _wait("rank 0's hang dump", lambda: (p := run_dir / "hangs" / "stacks.rank0.txt").exists()
                         and "Thread" in p.read_text() and p)
            assert "no step completed" in dump.read_text()
            assert _wait("the hang event", lambda: any(e["event"] == "hang" for e in events(run_dir)))
            assert _scrape(port)["crosstrain_step"] == stalled["crosstrain_step"]  # nothing moved meanwhile
        finally:
            os.kill(rank1, signal.SIGCONT)
        _wait("steps again", lambda: _scrape(port)["crosstrain_seconds_since_last_step"] < 1)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    assert "no step completed for" in err  # the hang event's message, on rank 0's stderr


def test_prometheus_metric_gauges_are_nan_until_written(tmp_path: Path) -> None:
    """Scraped over HTTP: ``crosstrain_eval_loss`` is NaN (not 0.0) until an evaluation wrote it, then keeps the
    last evaluation's value through steps without one."""
    from crosstrain.plugins.observability.prometheus import PrometheusSink

    sink = PrometheusSink(0)
    try:
        before = _scrape(sink.port)
        assert math.isnan(before["crosstrain_eval_loss"]) and math.isnan(before["crosstrain_loss"])
        sink.write(1, {"loss": 3.0})
        assert math.isnan(_scrape(sink.port)["crosstrain_eval_loss"]) and _scrape(sink.port)["crosstrain_loss"] == 3.0
        sink.write(2, {"loss": 2.9, "eval/loss": 2.5})
        sink.write(3, {"loss": 2.8})
        after = _scrape(sink.port)
        assert (after["crosstrain_eval_loss"], after["crosstrain_loss"], after["crosstrain_step"]) == (2.5, 2.8, 3)
    finally:
        sink.close()


def test_prometheus_port_in_use_is_a_one_line_error(tmp_path: Path, capsys) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code = crosstrain_main(["train", *_sets([*TINY, "parallel.dp_replicate=1", "train.steps=2",
                                                 f"observability.prometheus_port={port}"]),
                                "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and f"prometheus_port {port} on 127.0.0.1 is not free" in lines[0], err


def test_hang_dump_longer_than_the_collective_timeout_is_a_config_error(tmp_path: Path, capsys) -> None:
    code = crosstrain_main(["train", *_sets(["fault.collective_timeout_s=10", "observability.hang_dump_s=10"]),
                            "--run-dir", str(tmp_path / "run")])
    assert code == 2 and "must be shorter than fault.collective_timeout_s" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------------- MLflow
def _mlflow_run(run_dir: Path, monkeypatch: pytest.MonkeyPatch):
    """The run's MLflow client and run, read back from the file store in the run dir."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
    return client, client.get_run(json.loads((run_dir / "mlflow_run.json").read_text())["run_id"])


def _assert_mlflow_matches_metrics_jsonl(client, run, run_dir: Path) -> None:
    """Every numeric value of every metrics.jsonl record is in MLflow at its step (the last one logged for a step:
    a resumed run logs rolled-back steps again)."""
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    keys = {k for r in records for k, v in r.items() if k != "step" and isinstance(v, (int, float))}
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "eval/loss"} <= keys
    for key in keys:
        history = sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: (m.timestamp, m.step))
        logged = {m.step: m.value for m in history}
        assert logged == {r["step"]: float(r[key]) for r in records if isinstance(r.get(key), (int, float))}, key


def test_mlflow_store_holds_the_run_and_a_resume_continues_it(slow_run: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 alone logged one run: the flattened config as params, every step's metrics equal to metrics.jsonl,
    events as tags, the summary; resuming the run dir (12 -> 14 steps, 1 rank) continues that same run."""
    client, run = _mlflow_run(slow_run, monkeypatch)
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert len(client.search_runs([run.info.experiment_id])) == 1  # rank 1 logged nothing
    assert client.get_experiment(run.info.experiment_id).name == "crosstrain"
    params = run.data.params
    assert params["train.steps"] == "12" and params["observability.mlflow"] == "true"
    assert float(params["optim.lr"]) == json.loads((slow_run / "config.json").read_text())["optim"]["lr"]
    _assert_mlflow_matches_metrics_jsonl(client, run, slow_run)
    tags = run.data.tags
    stragglers = [json.loads(v) for k, v in tags.items() if k.startswith("event/") and k.endswith("/straggler")]
    assert stragglers and {e["rank"] for e in stragglers} == {1}
    assert "event/6/checkpoint" in tags and "event/12/checkpoint" in tags
    summary = json.loads((slow_run / "summary.json").read_text())
    assert run.data.metrics["summary/final_loss"] == summary["final_loss"]
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["summary.json"]

    from crosstrain.config import load_config
    from crosstrain.engine import Trainer

    resumed = tmp_path / "resumed"
    shutil.copytree(slow_run, resumed)
    one_rank = [o for o in TINY if not o.startswith("parallel.")]  # in this process: MLflow is imported already
    with pytest.warns(UserWarning, match="per-rank state"):  # saved by 2 ranks: only RNG and sampler differ
        Trainer(load_config(None, [*one_rank, "train.steps=14", "eval.every=6", "eval.steps=2", "checkpoint.every=6",
                                   "observability.mlflow=true"]), run_dir=resumed).fit()
    client, again = _mlflow_run(resumed, monkeypatch)
    assert again.info.run_id == run.info.run_id and again.info.status == "FINISHED"
    assert len(client.search_runs([again.info.experiment_id])) == 1
    assert "event/12/resume" in again.data.tags and again.data.tags["config_changed/train.steps"] == "14"
    assert [m.step for m in client.get_metric_history(again.info.run_id, "loss")] == list(range(1, 15))
    _assert_mlflow_matches_metrics_jsonl(client, again, resumed)


def test_mlflow_without_the_package_is_a_one_line_error(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """Found missing when the config is validated (before any worker or file); an import that fails anyway (a
    broken install) stops rank 0's sink with the same fix."""
    from crosstrain.config import load_config
    from crosstrain.errors import ConfigError
    from crosstrain.plugins.observability.mlflow_sink import MlflowSink, flatten, metric_key

    config = load_config(None, ["observability.mlflow=true"])
    monkeypatch.setitem(sys.modules, "mlflow", None)  # what Python does for a package that is not installed
    with pytest.raises(ConfigError, match=r'observability.mlflow.*pip install "crosstrain\[mlflow\]"'):
        load_config(None, ["observability.mlflow=true"])
    with pytest.raises(SystemExit) as exc:
        MlflowSink(config)
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and 'pip install "crosstrain[mlflow]"' in lines[0]
    assert flatten({"a": {"b": 1, "c": [1, 2], "d": {}}, "e": "x"}) == {"a.b": "1", "a.c": "[1, 2]", "a.d": "{}",
                                                                        "e": "x"}
    assert metric_key("moe/0/max_load") == "moe/0/max_load" and metric_key("a[b]=c") == "a_b__c"
