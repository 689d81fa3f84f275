"""``--recipe detect``: torchvision detection models trained on COCO-format data (docs/vision_detect.md)."""
