"""What a path given for model weights points to: the one answer ``crosstrain eval``, ``checkpoint.resume``,
``model.init_from``, ``crosstrain export``/``generate`` (every format) and ``checkpoint consolidate`` share.

A path may name

- a run dir (``config.toml`` or ``checkpoints/`` inside): its newest checkpoint that verifies, or with ``best``
  the one its ``checkpoints/best`` pointer names (``checkpoint.keep_best``);
- a ``checkpoints/`` folder (``step_N`` folders inside): the same, without the run dir around it;
- one checkpoint: a ``step_N`` folder, or any folder with a ``manifest.json``;
- a ``.safetensors`` file, or a folder holding ``model.safetensors`` (what ``export.safetensors`` writes);
- a Hugging Face model folder (``config.json`` naming a ``model_type``).

:func:`resolve_path` answers with a :class:`Resolved`: the kind of weights and the concrete path to read.
:func:`source_kind` is its cheap half: the kind alone, without picking (and so verifying) a checkpoint.

Errors are one line naming the fix: :class:`~crosstrain.errors.ConfigError` when the path is not something the
caller can read (missing, empty, another kind, ``best`` on a single checkpoint, nothing saved yet),
:class:`~crosstrain.errors.CheckpointError` when what is there is broken (every ``step_N`` fails verification,
a corrupt ``best`` pointer).
"""

from __future__ import annotations

import os
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from crosstrain.checkpoint.manager import (
    BEST_FILE,
    CheckpointInfo,
    best_problem,
    find_best,
    find_latest,
    looks_like_step_dir,
    step_dirs,
    step_number,
)
from crosstrain.checkpoint.manifest import MANIFEST_FILE, Manifest
from crosstrain.errors import CheckpointError, ConfigError

Kind = Literal["checkpoint", "safetensors", "hf"]
EVERY_KIND: tuple[Kind, ...] = ("checkpoint", "safetensors", "hf")
CHECKPOINT: tuple[Kind, ...] = ("checkpoint",)
_NOUNS: dict[Kind, tuple[str, ...]] = {"checkpoint": ("a run dir", "its checkpoints/ folder", "a step_N folder"),
                                       "safetensors": ("a .safetensors file",), "hf": ("a Hugging Face model folder",)}
_NAME: dict[Kind, str] = {"checkpoint": "a crosstrain checkpoint", "safetensors": "a .safetensors file",
                          "hf": "a Hugging Face model folder"}

#: how the path names its weights: a run dir, a folder of ``step_N``, one ``step_N``, or the weights themselves
_Form = Literal["run", "folder", "step", "file"]


@dataclass(frozen=True)
class Resolved:
    """What a path points to: ``kind`` of weights and the concrete ``path`` to read (a ``step_N`` folder, a
    ``.safetensors`` file or a Hugging Face folder). For a checkpoint: the ``run_dir`` it belongs to (None when
    it sits outside a run's ``checkpoints/``), its ``step``, and ``verified`` when its checksums were just
    checked (picked among several); an explicitly named ``step_N`` is left for the loader to verify."""

    kind: Kind
    path: Path
    run_dir: Path | None = None
    step: int | None = None
    verified: bool = False

    @property
    def info(self) -> CheckpointInfo:
        """The checkpoint as :class:`~crosstrain.checkpoint.manager.CheckpointInfo` (kind ``checkpoint`` only)."""
        if self.kind != "checkpoint" or self.step is None:
            raise ValueError(f"{self.path} is a {self.kind}, not a checkpoint")
        return CheckpointInfo(self.step, self.path, self.verified)


def resolve_path(path: str | os.PathLike[str] | Resolved, *, what: str = "", accept: Collection[Kind] = EVERY_KIND,
                 best: bool = False) -> Resolved:
    """What ``path`` points to, as one of the ``accept`` kinds; a run dir or ``checkpoints/`` folder gives its
    newest valid checkpoint (or, with ``best``, its best one). ``what`` names the path in errors (a config key
    such as ``model.init_from``; empty for a command's argument). A :class:`Resolved` comes back as it is."""
    if isinstance(path, Resolved):
        _check_kind(path.kind, repr(str(path.path)), accept)
        return path
    p = Path(path)
    subject = _subject(p, what)
    kind, form, target = _classify(p, subject, accept)
    _check_kind(kind, subject, accept)
    if best and form not in ("run", "folder"):
        single = "a single checkpoint" if form == "step" else _NAME[kind]
        raise ConfigError(f"{subject} is {single}, and best picks among a run's checkpoints; pass the run dir")
    if kind != "checkpoint":
        return Resolved(kind, target)
    if form == "step":
        step = step_number(p.name)
        return Resolved(kind, p, p.parent.parent if p.parent.name == "checkpoints" else None,
                        step if step is not None else Manifest.read(p).step)
    folder = p / "checkpoints" if form == "run" else p
    run_dir = p if form == "run" else (p.parent if p.name == "checkpoints" else None)
    info = _best(folder, subject) if best else _latest(folder, subject, p)
    return Resolved(kind, info.path, run_dir, info.step, info.verified)


def source_kind(path: str | os.PathLike[str], *, what: str = "", accept: Collection[Kind] = EVERY_KIND) -> Kind:
    """The kind of weights ``path`` names (the errors of :func:`resolve_path` for a path that names none), without
    picking or verifying a checkpoint: cheap enough for config checks."""
    p = Path(path)
    subject = _subject(p, what)
    kind = _classify(p, subject, accept)[0]
    _check_kind(kind, subject, accept)
    return kind


def _subject(p: Path, what: str) -> str:
    return f"{what} {str(p)!r}" if what else repr(str(p))


def _wanted(accept: Collection[Kind]) -> str:
    """``a run dir, its checkpoints/ folder or a step_N folder`` and so on, for the kinds in ``accept``."""
    nouns = [noun for kind in EVERY_KIND if kind in accept for noun in _NOUNS[kind]]
    return nouns[0] if len(nouns) == 1 else ", ".join(nouns[:-1]) + " or " + nouns[-1]


def _check_kind(kind: Kind, subject: str, accept: Collection[Kind]) -> None:
    if kind not in accept:
        raise ConfigError(f"{subject} is {_NAME[kind]}, which is not accepted here; pass {_wanted(accept)}")


def _classify(p: Path, subject: str, accept: Collection[Kind]) -> tuple[Kind, _Form, Path]:
    """``(kind, form, path to read)`` from the files alone (no checksums). The order matters: a run dir also
    holds a config.json (its run config, without ``model_type``), and an HF folder never holds checkpoints."""
    from crosstrain.models.hf import is_hf_folder, read_hf_config

    wanted = _wanted(accept)
    if not p.exists():
        raise ConfigError(f"{subject} does not exist; pass {wanted}")
    if p.is_file():
        if p.suffix == ".safetensors":
            return "safetensors", "file", p
        raise ConfigError(f"{subject}: unsupported file type {p.suffix!r}; pass {wanted}")
    if (p / MANIFEST_FILE).is_file() or step_number(p.name) is not None:
        return "checkpoint", "step", p
    if looks_like_step_dir(p):
        raise ConfigError(f"{subject} is a checkpoint whose save never finished; pass a committed step_N folder "
                          "or the run dir (its newest valid checkpoint)")
    if is_hf_folder(p):
        return "hf", "file", p
    if (p / "config.toml").is_file() or (p / "checkpoints").is_dir():
        return "checkpoint", "run", p
    if p.name == "checkpoints" or step_dirs(p):
        return "checkpoint", "folder", p
    if (p / "config.json").is_file():  # meant as a Hugging Face folder: a broken config.json is the problem
        read_hf_config(p)
        raise ConfigError(f"{subject}: its config.json has no model_type, so it is not a Hugging Face model folder, "
                          f"and it holds no checkpoint; fix config.json or pass {wanted}")
    if (p / "model.safetensors").is_file():
        return "safetensors", "file", p / "model.safetensors"
    if not any(p.iterdir()):
        raise ConfigError(f"{subject} is empty; pass {wanted}")
    raise ConfigError(f"{subject} holds no checkpoint, model.safetensors or Hugging Face config.json; pass {wanted}")


def _latest(folder: Path, subject: str, given: Path) -> CheckpointInfo:
    if not step_dirs(folder):
        raise ConfigError(f"{subject} holds no checkpoint (step_N folder) yet; a run saves one at its end unless "
                          "checkpoint.final=false, and every checkpoint.every steps")
    info = find_latest(folder)
    if info is None:
        raise CheckpointError(f"{subject} has no valid checkpoint: every step_N failed verification (`crosstrain "
                              f"checkpoint ls {given} --check` says why); pass a step_N folder that verifies")
    return info


def _best(folder: Path, subject: str) -> CheckpointInfo:
    info = find_best(folder)
    if info is None:  # no pointer: nothing to fix in the files; a bad pointer: the files are the problem
        error = CheckpointError if (folder / BEST_FILE).exists() else ConfigError
        raise error(f"{subject} has {best_problem(folder)}")
    return info
