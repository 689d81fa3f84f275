"""The ``compress`` plugin: model compression in training (docs/compress.md). Knowledge distillation:
``--recipe distill`` and ``crosstrain distill cache`` (:mod:`crosstrain.plugins.compress.distill`); quantization-aware
training: the ``[quant]`` section (:mod:`crosstrain.plugins.compress.qat`)."""
