"""The scheduler thread: admits requests into the serving version's batch between decode steps and steps every
version that still has live sequences (continuous batching; Yu et al. 2022, "Orca").

An idle scheduler that gets a request waits up to ``max_wait_ms`` for more (dynamic batching, as Triton's
``max_queue_delay``) so a burst starts as one batch; once decoding, arrivals join at the next step without
waiting. The serving version is read from the :class:`ModelManager` once per loop, so a hot swap lands between
two steps; sequences keep the version they were admitted to until they finish.

Isolation: whatever one request does, the others decode on unchanged. A job leaves only through :meth:`_leave`
(done at prefill, a stop, its token budget, its client gone, or its own failure), which frees its row. A decode step
that raises is undone by the batch and run again row by row (``batch.step_alone``): a row that fails alone fails
its own job (OpenAI's 500 ``server_error`` body, or an SSE error event then ``[DONE]`` for a stream), and every
other row gets the token the batched step would have given it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque

from crosstrain.errors import CrosstrainError
from crosstrain.generation.continuous import Sequence
from crosstrain.plugins.serve.manager import ModelManager
from crosstrain.plugins.serve.metrics import ServeMetrics
from crosstrain.plugins.serve.requests import Job
from crosstrain.plugins.serve.versions import Version


class Scheduler:
    def __init__(self, manager: ModelManager, metrics: ServeMetrics, max_batch: int, max_wait_ms: float) -> None:
        self.manager = manager
        self.metrics = metrics
        self.max_batch = max_batch
        self.max_wait_s = max_wait_ms / 1000
        self._inbox: queue.Queue[Job] = queue.Queue()
        self._waiting: deque[Job] = deque()
        self._running: dict[int, tuple[Version, list[Job]]] = {}  # version number -> its live jobs
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="crosstrain-serve-scheduler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def submit(self, job: Job) -> None:
        self._inbox.put(job)
        self.metrics.queue_depth.set(self._inbox.qsize() + len(self._waiting))

    @property
    def live(self) -> int:
        return sum(len(jobs) for _, jobs in self._running.values())

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._collect()
                self._admit()
                self._step()
            except Exception as exc:  # a bug outside any one job's decoding: fail what is in flight, keep serving
                for version, jobs in list(self._running.values()):
                    for job in list(jobs):
                        self._leave(version, job, _internal("serving", exc))
                self._running.clear()

    def _collect(self) -> None:
        """Move submitted jobs to the waiting line; when idle, block for the first and then wait up to
        ``max_wait_ms`` for up to ``max_batch`` of them."""
        if not self.live and not self._waiting:
            try:
                self._waiting.append(self._inbox.get(timeout=0.1))
            except queue.Empty:
                return
            deadline = time.monotonic() + self.max_wait_s
            while len(self._waiting) < self.max_batch:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    self._waiting.append(self._inbox.get(timeout=left))
                except queue.Empty:
                    break
        while True:
            try:
                self._waiting.append(self._inbox.get_nowait())
            except queue.Empty:
                break

    def _admit(self) -> None:
        version = self.manager.current  # a swap lands here, between two decode steps
        if version.number not in self._running:
            self._running[version.number] = (version, [])
        jobs = self._running[version.number][1]
        while self._waiting and version.batch.free > 0 and self.live < self.max_batch:
            job = self._waiting.popleft()
            if job.cancelled:
                continue
            seq = Sequence(job.prompt, job.config, job.generator, tag=job, alternatives=job.alternatives,
                           score_prompt=job.score_prompt)
            job.seq = seq
            try:
                version.batch.add(seq)
            except CrosstrainError as exc:  # e.g. a prompt that no longer fits a swapped-in version's context
                self._leave(version, job, (400, str(exc)))
                continue
            except Exception as exc:  # this job only: the others keep decoding
                self._leave(version, job, _internal("prefilling", exc))
                continue
            job.started(version)
            jobs.append(job)
            self._feed(version, job)  # done at prefill (a stop string on the first token) leaves at once
        self.metrics.queue_depth.set(self._inbox.qsize() + len(self._waiting))

    def _step(self) -> None:
        for number, (version, jobs) in list(self._running.items()):
            for job in [j for j in jobs if j.cancelled]:
                self._leave(version, job)
            if jobs:
                self.metrics.batch_size.observe(len(jobs))
                self._decode(version, jobs)
                for job in list(jobs):
                    self._feed(version, job)
            if not jobs and version is not self.manager.current:
                del self._running[number]  # an old version with nothing in flight: let it go

    def _decode(self, version: Version, jobs: list[Job]) -> None:
        """One token for every live row: one batched step, or, when it raises (the batch undid it), one step per
        row, failing only the jobs whose row fails alone."""
        try:
            version.batch.step()
            return
        except Exception:
            pass
        for job in list(jobs):
            try:
                version.batch.step_alone(job.seq)
            except Exception as exc:
                self._leave(version, job, _internal("decoding this request", exc))

    def _feed(self, version: Version, job: Job) -> None:
        """Hand the job its sequence's tokens so far; a job that is done, or whose own text handling raised,
        leaves."""
        try:
            going = job.feed(job.seq)
        except Exception as exc:
            self._leave(version, job, _internal("decoding this request's text", exc))
            return
        if not going:
            self._leave(version, job)

    def _leave(self, version: Version, job: Job, error: tuple[int, str] | None = None) -> None:
        """The one way a job leaves (done at prefill, stopped, out of tokens, cancelled, failed): its row is freed,
        it leaves its version's live jobs, then it ends, with its text or with ``error`` (status, message)."""
        if job.seq is not None:
            version.batch.drop(job.seq)
        running = self._running.get(version.number)
        if running is not None and job in running[1]:
            running[1].remove(job)
        if error is None:
            try:
                job.finish(job.seq)
                return
            except Exception as exc:  # its last text could not be decoded: it still gets an answer
                error = _internal("decoding this request's text", exc)
        job.fail(*error)


def _internal(doing: str, exc: Exception) -> tuple[int, str]:
    return 500, f"internal error while {doing}: {type(exc).__name__}: {exc}"
