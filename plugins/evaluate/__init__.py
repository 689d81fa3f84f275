"""lm-evaluation-harness in process: a crosstrain model as lm-eval's ``LM`` ("crosstrain"), ``crosstrain eval RUN
--tasks ...`` and ``[eval] tasks`` scored at each evaluation during training. Needs the ``eval`` extra."""
