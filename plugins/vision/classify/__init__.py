"""``--recipe classify``: image classification (docs/vision.md). Models (:mod:`.models`), losses (:mod:`.losses`),
metrics (:mod:`.metrics`), EMA of the weights (:mod:`.ema`) and the recipe (:mod:`.recipe`)."""
