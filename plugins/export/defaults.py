"""The export's parity tolerances, shared by the ``crosstrain export`` flags and the ``[export]`` section;
importable without torch, so ``crosstrain export --help`` answers at once."""

#: Default max abs logit error of the fp32 ONNX model against PyTorch.
DEFAULT_TOLERANCE = 1e-4
#: Default max abs logit error accepted for the int8 model (dynamic quantization is lossy by design).
DEFAULT_INT8_TOLERANCE = 1.0
