"""The MLflow sink: ``[observability] mlflow = true`` records rank 0's run in an MLflow tracking store.

Params: the resolved config, flattened (``train.steps``, ``optim.lr``, ...). Metrics: every key of every step,
at that step. Events (resume, checkpoint, straggler, ...): one tag each, ``event/<step>/<name>`` = the event's
JSON. At the end: ``summary.json`` as an artifact, its numbers as ``summary/<key>`` metrics, and the run's status
(FINISHED, KILLED when preempted, FAILED when no summary was written). The default store is the file store in
``<run_dir>/mlruns`` (``mlflow ui --backend-store-uri <run_dir>/mlruns``). The run id is kept in
``<run_dir>/mlflow_run.json``, so a resumed run continues the same MLflow run.

Overhead: ``write`` only queues the step's values; a daemon thread sends them with ``MlflowClient.log_batch``
every :data:`FLUSH_S` seconds (the file store appends one file per metric, ~0.1 ms each, too slow to do inline
per step), and ``close`` sends the rest.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from crosstrain.checkpoint.atomic import atomic_write
from crosstrain.engine.metrics import SinkInfo

#: seconds between two batches sent by the background thread
FLUSH_S = 5.0
#: MLflow's limits per log_batch call (mlflow.utils.validation) and per value
_MAX_METRICS, _MAX_PARAMS, _MAX_TAGS = 1000, 100, 100
_MAX_PARAM_VALUE, _MAX_TAG_VALUE = 6000, 8000
RUN_FILE = "mlflow_run.json"


def missing_message() -> str:
    return ('crosstrain: error: [observability] mlflow = true needs MLflow; install it with: '
            'pip install "crosstrain[mlflow]" (or set observability.mlflow=false)')


def metric_key(key: str) -> str:
    """``key`` with the characters MLflow rejects in names (anything but letters, digits, ``_-. :/``) as ``_``."""
    return re.sub(r"[^\w\-. :/]", "_", key)


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"train": {"steps": 10}}`` -> ``{"train.steps": "10"}``; lists and None as JSON."""
    out: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value if isinstance(value, str) else json.dumps(value)
    return out


def _chunks(items: list[Any], size: int) -> list[list[Any]]:
    return [items[i:i + size] for i in range(0, len(items), size)]


class MlflowSink:
    """A metrics sink that logs to MLflow from rank 0 (the sinks hook is called on rank 0 only).

    ``tracking_uri`` "": the file store in ``<run_dir>/mlruns``. A missing ``mlflow`` package is a config error
    (``ObservabilityConfig``); an import that fails anyway stops the run here with one line on stderr (exit 2).
    """

    def __init__(self, config: Any) -> None:
        try:
            from mlflow import MlflowClient  # noqa: F401
        except ImportError:
            print(missing_message(), file=sys.stderr, flush=True)
            raise SystemExit(2) from None  # not an Exception: a sink hook's failure would only be logged
        obs = config.section("observability")
        self.params = flatten(config.to_dict())  # TOML key names, as in config.toml
        self.tracking_uri: str = obs.mlflow_tracking_uri
        self.experiment: str = obs.mlflow_experiment
        self.run_id = ""
        self._pending: list[Any] = []  # Metric and RunTag entities not sent yet
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: str | None = None
        self._tag_keys: set[str] = set()

    def open(self, info: SinkInfo) -> None:
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException

        self.run_dir = info.run_dir
        self._opened = time.time()
        uri = self.tracking_uri or (Path(info.run_dir).resolve() / "mlruns").as_uri()
        if urlparse(uri).scheme in ("", "file"):
            # mlflow-skinny has no SQLAlchemy, so the file store is its only local one; MLflow 3 refuses it
            # unless this is set (an explicit "false" from the user is kept: the error below disables the sink)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        try:
            self.client = MlflowClient(tracking_uri=uri)
            self.run_id = self._resume_run() or self._new_run()
        except MlflowException as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise RuntimeError(f"MLflow store {uri}: {first}") from None
        self._thread = threading.Thread(target=self._flush_loop, name="crosstrain-mlflow", daemon=True)
        self._thread.start()

    def _resume_run(self) -> str:
        """The run recorded in the run dir, set running again, with the config keys it lacks; "" if none."""
        from mlflow.entities import Param, RunTag
        from mlflow.exceptions import MlflowException

        path = Path(self.run_dir) / RUN_FILE
        if not path.exists():
            return ""
        run_id = str(json.loads(path.read_text()).get("run_id", ""))
        try:
            run = self.client.get_run(run_id)
        except MlflowException:  # another store (tracking_uri changed): start a new run there
            print(f"crosstrain: warning: MLflow run {run_id} from {path} is not in this store; starting a new one",
                  file=sys.stderr)
            return ""
        self.client.update_run(run_id, status="RUNNING")
        known = run.data.params
        new = [Param(k, v[:_MAX_PARAM_VALUE]) for k, v in self.params.items() if k not in known]
        # MLflow params cannot change: a key set differently on resume is kept as a tag
        changed = [RunTag(f"config_changed/{k}", v[:_MAX_TAG_VALUE]) for k, v in self.params.items()
                   if k in known and known[k] != v[:_MAX_PARAM_VALUE]]
        self._send(new, changed, run_id)
        return run_id

    def _new_run(self) -> str:
        from mlflow.entities import Param

        found = self.client.get_experiment_by_name(self.experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(self.experiment)
        run = self.client.create_run(experiment_id, run_name=Path(self.run_dir).resolve().name,
                                     tags={"crosstrain.run_dir": str(Path(self.run_dir).resolve())})
        self._send([Param(k, v[:_MAX_PARAM_VALUE]) for k, v in self.params.items()], [], run.info.run_id)
        atomic_write(Path(self.run_dir) / RUN_FILE, (json.dumps(
            {"run_id": run.info.run_id, "experiment_id": experiment_id, "tracking_uri": self.client.tracking_uri},
            indent=2) + "\n").encode())
        return str(run.info.run_id)

    def _send(self, params: list[Any], entities: list[Any], run_id: str = "") -> None:
        """``log_batch`` within MLflow's per-call limits: params first, then metrics and tags in order."""
        from mlflow.entities import Metric

        run_id = run_id or self.run_id
        for chunk in _chunks(params, _MAX_PARAMS):
            self.client.log_batch(run_id, params=chunk)
        metrics = [e for e in entities if isinstance(e, Metric)]
        tags = [e for e in entities if not isinstance(e, Metric)]
        for chunk in _chunks(metrics, _MAX_METRICS):
            self.client.log_batch(run_id, metrics=chunk)
        for chunk in _chunks(tags, _MAX_TAGS):
            self.client.log_batch(run_id, tags=chunk)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        if self._error:
            raise RuntimeError(self._error)  # the hub reports it once and drops this sink
        now = int(time.time() * 1000)
        entries = [Metric(metric_key(k), float(v), now, step) for k, v in metrics.items()
                   if isinstance(v, (int, float))]
        with self._lock:
            self._pending.extend(entries)

    def event(self, step: int, name: str, fields: dict[str, Any]) -> None:
        from mlflow.entities import RunTag

        value = json.dumps({"step": step, "event": name, "time": time.time(), **fields}, default=str)
        key = base = metric_key(f"event/{step}/{name}")
        n = 1
        while key in self._tag_keys:  # e.g. two plugin errors in one step: keep both
            n += 1
            key = f"{base}_{n}"
        self._tag_keys.add(key)
        tag = RunTag(key, value[:_MAX_TAG_VALUE])
        with self._lock:
            self._pending.append(tag)

    def flush(self) -> None:
        """Send what is queued now (the background thread calls this every FLUSH_S seconds)."""
        with self._lock:
            batch, self._pending = self._pending, []
        if batch:
            self._send([], batch)

    def _flush_loop(self) -> None:
        while not self._stop.wait(FLUSH_S):
            try:
                self.flush()
            except Exception as exc:  # reported by the next write (on the loop's thread), then dropped
                self._error = f"MLflow logging failed: {type(exc).__name__}: {exc}"
                return

    def _summary(self) -> dict[str, Any] | None:
        """This session's summary.json, or None (a failed run; one from an earlier session does not count)."""
        path = Path(self.run_dir) / "summary.json"
        if not path.exists() or path.stat().st_mtime < self._opened - 1:
            return None
        return dict(json.loads(path.read_text()))

    def close(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        from mlflow.entities import Metric

        summary = self._summary()
        if summary is not None:
            now, step = int(time.time() * 1000), int(summary.get("steps", 0))
            with self._lock:
                self._pending += [Metric(metric_key(f"summary/{k}"), float(v), now, step) for k, v in summary.items()
                                  if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
        self.flush()
        if summary is not None:
            self.client.log_artifact(self.run_id, str(Path(self.run_dir) / "summary.json"))
        status = "FAILED" if summary is None else "KILLED" if summary.get("preempted") else "FINISHED"
        self.client.set_terminated(self.run_id, status=status)
