"""Errors the export plugin reports to users as one line."""

from __future__ import annotations

from crosstrain.errors import CrosstrainError


class ExportError(CrosstrainError):
    """The model or input cannot be exported or run (unsupported model, impossible shape, bad file)."""

    exit_code = 6


class ParityError(ExportError):
    """The exported graph's logits differ from PyTorch's by more than the tolerance; nothing was written."""

    exit_code = 7
