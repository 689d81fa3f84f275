"""Built-in models and the model-family registry (:mod:`crosstrain.models.family`): the GPT (``gpt.py``) and its
bundle (``gpt_family.py``), Hugging Face checkpoints (``hf/``), document masks for packed batches."""
