"""Train-to-inference export: ONNX (with KV cache) and safetensors, parity checks, generation.

Heavy imports (onnx, onnxruntime, torch.onnx) happen inside the functions that need them, so loading the
plugin to add its CLI commands and config section stays cheap.
"""

from crosstrain.plugins.export.errors import ExportError, ParityError

__all__ = ["ExportError", "ParityError"]
