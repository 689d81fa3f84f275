"""The Ascend NPU backend: ``torch_npu`` (imported lazily, never at ``import crosstrain``), HCCL, fused ops."""
