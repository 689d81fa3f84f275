"""The vision plugin: image recipes on torchvision (``detect``: object detection, docs/vision_detect.md)."""
