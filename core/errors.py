"""Errors that crosstrain reports to users as one clear line."""

from __future__ import annotations


def first_line(exc: BaseException, limit: int = 200) -> str:
    """The first line of ``exc``'s message (its type's name when empty), cut to ``limit`` characters with "..."."""
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return first[:limit] + "..." if len(first) > limit else first


class CrosstrainError(Exception):
    """Base class for errors crosstrain raises on purpose."""


class ConfigError(CrosstrainError):
    """A configuration value is missing, unknown, mistyped or impossible. The CLI exits with code 2."""

    exit_code = 2


class BackendUnavailableError(CrosstrainError):
    """The requested backend cannot run on this machine (the message says why)."""

    exit_code = 3


class PluginError(CrosstrainError):
    """A plugin misbehaved in a way that cannot be isolated (e.g. two plugins claim one backend name)."""

    exit_code = 4


class KernelError(CrosstrainError):
    """Unknown kernel op, or an implementation that cannot take the given inputs."""


class CheckpointError(CrosstrainError):
    """A checkpoint is missing, incomplete, corrupt or unsafe to load."""

    exit_code = 5


class CollectiveError(CrosstrainError):
    """A collective failed: mismatched arguments across ranks, or a timeout (names the op and rank)."""


class CrosstrainWarning(UserWarning):
    """Input that works but probably not as meant; the CLI prints it as one ``crosstrain: warning:`` line."""


class DeviceOutOfMemoryError(CrosstrainError):
    """The run does not fit in device memory (the message names the settings that make it fit)."""
