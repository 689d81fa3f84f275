"""The scheduler thread: admits requests into the serving version's batch between decode steps and steps every
version that still has live sequences (continuous batching; Yu et al. 2022, "Orca").

An idle scheduler that gets a request waits up to ``max_wait_ms`` for more (dynamic batching, as Triton's
``max_queue_delay``) so a burst starts as one batch; once decoding, arrivals join at the next step without
waiting. The serving version is read from the :class:`ModelManager` once per loop, so a hot swap lands between
two steps; sequences keep the version they were admitted to until they finish.
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
            except Exception as exc:  # never leave clients hanging: fail what is in flight, keep serving
                for version, jobs in self._running.values():
                    for seq in list(version.batch.live):
                        version.batch.drop(seq)
                    for job in jobs:
                        job.fail(500, f"internal error while decoding: {type(exc).__name__}: {exc}")
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
            try:
                version.batch.add(seq)
            except CrosstrainError as exc:  # e.g. a prompt that no longer fits a swapped-in version's context
                job.fail(400, str(exc))
                continue
            except Exception as exc:  # this job only: the others keep decoding
                job.fail(500, f"internal error while prefilling: {type(exc).__name__}: {exc}")
                continue
            job.started(version)
            if job.feed(seq):
                jobs.append(job)
            else:  # done at prefill (a stop string on the first token)
                self._release(version, job, seq)
        self.metrics.queue_depth.set(self._inbox.qsize() + len(self._waiting))

    @staticmethod
    def _release(version: Version, job: Job, seq: Sequence) -> None:
        """The one way a sequence leaves a batch (done at prefill, stopped, out of tokens, cancelled): its row is
        freed, then its job ends."""
        version.batch.drop(seq)
        job.finish(seq)

    def _step(self) -> None:
        for number, (version, jobs) in list(self._running.items()):
            for job in [j for j in jobs if j.cancelled]:
                self._release(version, job, job.seq)
                jobs.remove(job)
            if jobs:
                self.metrics.batch_size.observe(len(jobs))
                version.batch.step()
                for job in list(jobs):
                    if not job.feed(job.seq):
                        self._release(version, job, job.seq)
                        jobs.remove(job)
            if not jobs and version is not self.manager.current:
                del self._running[number]  # an old version with nothing in flight: let it go
