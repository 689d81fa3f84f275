"""Knowledge distillation (docs/compress.md): the divergences (:mod:`.losses`), the teacher (:mod:`.teacher`), the
data and its batches (:mod:`.data`), on-policy student samples (:mod:`.onpolicy`), the offline teacher cache
(:mod:`.cache`), the ``distill`` recipe (:mod:`.recipe`) and ``crosstrain distill cache`` (:mod:`.cli`)."""
