"""Model compression: quantization-aware training (:mod:`.qat`) and knowledge distillation."""
