"""The ``vision`` plugin: image recipes on the same engine (docs/vision.md). ``--recipe classify``
(:mod:`crosstrain.plugins.vision.classify`) over image data (:mod:`crosstrain.plugins.vision.data`) and ``--recipe
detect`` (:mod:`crosstrain.plugins.vision.detect`, object detection with torchvision, docs/vision_detect.md)."""
