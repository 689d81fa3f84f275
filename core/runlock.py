"""One job per run dir: ``<run_dir>/.crosstrain.lock`` holds an exclusive ``flock`` and the holder's PID.

The kernel drops a ``flock`` when its holder dies, however it dies, so a lock file left by a killed job is
stale by construction and the next job takes it over. The PID inside is only for the error message (and for
file systems without ``flock``, where a holder whose PID is gone counts as stale). The workers of
``crosstrain train --nproc`` run under the lock their launcher holds: they borrow it (no second lock).
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

from crosstrain.errors import ConfigError, CrosstrainError

LOCK_FILE = ".crosstrain.lock"

try:
    import fcntl
except ImportError:  # Windows: PID liveness only
    fcntl = None  # type: ignore[assignment]


class RunDirBusyError(CrosstrainError):
    """Another live job uses the run dir."""

    exit_code = 6


def pid_alive(pid: int) -> bool:
    """Whether a process with ``pid`` exists (a zombie counts as gone)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # Linux: a zombie has exited; only its parent has not reaped it yet
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


class RunDirLock:
    """The lock of one run dir; :meth:`acquire` raises :class:`RunDirBusyError` naming the holder's PID."""

    def __init__(self, run_dir: str | os.PathLike[str], *, created: bool = False) -> None:
        self.run_dir = Path(run_dir)
        self.created = created  # this job made the run dir: release() removes it if nothing was written
        self.path = self.run_dir / LOCK_FILE
        self._fd: int | None = None
        self.borrowed = False
        self.took_over: int | None = None  # PID of a dead job whose lock file this one replaced

    def acquire(self) -> RunDirLock:
        if self._borrowed_from_launcher():
            self.borrowed = True
            return self
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                holder = _read_pid(fd)
                if not self._lock(fd, holder):
                    raise RunDirBusyError(
                        f"run dir {self.run_dir} is in use by another job (pid {holder or 'unknown'}); wait for it "
                        f"to end, stop it, or pass another --run-dir")
                # a releasing holder unlinks the file before unlocking: we may hold a lock on a removed inode
                if _same_file(fd, self.path):
                    break
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
        if holder and holder != os.getpid():
            self.took_over = holder
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    def _lock(self, fd: int, holder: int) -> bool:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                return False
            except OSError as exc:  # a file system without flock (some network mounts)
                if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    raise
        return not (holder and holder != os.getpid() and pid_alive(holder))

    def _borrowed_from_launcher(self) -> bool:
        from crosstrain.parentwatch import launcher_pid

        launcher = launcher_pid()
        if launcher is None or launcher != os.getppid():
            return False
        try:
            return int(self.path.read_text().split()[0]) == launcher
        except (OSError, ValueError, IndexError):
            return False

    def release(self) -> None:
        """Remove the lock file, then unlock (so nobody locks a file that is about to disappear)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(fd)
        if self.created and not any(p.is_file() for p in self.run_dir.rglob("*")):
            shutil.rmtree(self.run_dir, ignore_errors=True)  # a job that failed before writing anything

    def __enter__(self) -> RunDirLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_pid(fd: int) -> int:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        return int(os.read(fd, 32).split()[0])
    except (ValueError, IndexError, OSError):
        return 0


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def lock_dir(run_dir: str | os.PathLike[str]) -> RunDirLock:
    """Create (if needed) and lock ``run_dir``; a folder that cannot be made is a one-line :class:`ConfigError`."""
    path = Path(run_dir)
    created = not path.exists()
    try:
        path.mkdir(parents=True, exist_ok=True)
        return RunDirLock(path, created=created).acquire()
    except OSError as exc:
        raise ConfigError(f"run dir {str(run_dir)!r} cannot be created or locked ({exc.strerror or exc}); pass a "
                          "writable --run-dir or train.output_dir") from None


def lock_together(collective: Any, run_dir: str | os.PathLike[str]) -> RunDirLock | None:
    """Rank 0 creates and locks ``run_dir``; every rank raises the same one-line error when it could not."""
    lock: RunDirLock | None = None
    error: tuple[str, str] | None = None
    if collective.rank == 0:
        try:
            lock = lock_dir(run_dir)
        except (RunDirBusyError, ConfigError) as exc:
            error = (type(exc).__name__, str(exc))
    if collective.world_size > 1:
        error = collective.all_gather_object(error)[0]
    if error is not None:
        raise RunDirBusyError(error[1]) if error[0] == "RunDirBusyError" else ConfigError(error[1])
    return lock
