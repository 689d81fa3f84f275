"""The teacher: any model crosstrain loads through its one path resolver, checked against the student's vocabulary."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from crosstrain.errors import ConfigError, CrosstrainError

WHAT = "distill.teacher"


@dataclass
class Teacher:
    """The loaded teacher (fp32, eval mode, on CPU), where its weights were read and their SHA-256."""

    model: nn.Module
    source: str
    sha256: str
    vocab_size: int


def check_source(path: str) -> None:
    """A one-line error unless ``path`` names weights crosstrain can read (checked before anything is built)."""
    from crosstrain.checkpoint.resolve import source_kind

    if not path:
        raise ConfigError("--recipe distill needs a teacher: set distill.teacher=RUN_DIR|CHECKPOINT|HF_FOLDER (or "
                          "distill.cache=FILE from `crosstrain distill cache`); `crosstrain distill demo` trains a "
                          "teacher on the embedded corpus and distills it in one command")
    source_kind(path, what=WHAT)


def load_teacher(path: str, student_vocab: int) -> Teacher:
    """The teacher at ``path`` (a run dir, checkpoint, .safetensors file or Hugging Face folder: the export
    plugin's loader, which finds the model config beside the weights), refused in one line when its vocabulary is
    not the student's."""
    from crosstrain.engine.models import frozen_sha256
    from crosstrain.plugins.export.loading import load_model

    try:
        loaded = load_model(path, what=WHAT)
    except ConfigError:
        raise
    except CrosstrainError as exc:  # a file that is not a model crosstrain can read: the user's input, exit 2
        raise ConfigError(f"{WHAT}: {exc}") from exc
    check_vocab(int(loaded.config.vocab_size), student_vocab, loaded.source)
    model = loaded.model.eval().requires_grad_(False)
    source = str(Path(loaded.source).resolve())
    return Teacher(model, source, frozen_sha256(model), int(loaded.config.vocab_size))


def check_vocab(teacher_vocab: int, student_vocab: int, source: str) -> None:
    """The divergence compares the two distributions token by token: both models must read the same ids."""
    if teacher_vocab != student_vocab:
        raise ConfigError(f"{WHAT} {source} has a vocabulary of {teacher_vocab} tokens but the student has "
                          f"{student_vocab}; distill from a teacher trained with the same data.tokenizer")


def record(teacher: Teacher | Any) -> dict[str, Any]:
    """What summary.json records about the teacher."""
    return {"source": teacher.source, "sha256": teacher.sha256, "vocab_size": teacher.vocab_size}
