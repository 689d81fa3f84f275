"""Quantization-aware training: ``[quant] qat = "int8" | "int8-act-int4-weight"`` fake-quantises the linear layers
of every trained model (torchao's QAT schemes, Jacob et al. 2018), and ``crosstrain export --quantize`` writes the
integer model. Pure functions in :mod:`.fake_quant`, the module swap in :mod:`.linear`, ONNX in :mod:`.onnx`."""
