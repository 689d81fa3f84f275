"""Example third-party crosstrain backend for Intel GPUs (torch.xpu), packaged on its own."""
