"""The generic path: any decoder-only ``AutoModelForCausalLM`` transformers can build, trained under crosstrain's
loop (``model.source = "transformers"``, or ``"auto"`` with a ``model.init_from`` folder of a family crosstrain
has no native model for).

- :mod:`.wrapper`: the model class (the transformers class with crosstrain's interface mixed in: logits from
  ``forward(tokens)``, the generation cache protocol, the parallel plans);
- :mod:`.plans`: FSDP2/activation-checkpointing units from ``_no_split_modules``, tensor parallelism from the
  config's ``base_model_tp_plan``;
- :mod:`.config`: :class:`GenericConfig` from the run's ``[model]`` section;
- :mod:`.family`: the ``generic`` :class:`~crosstrain.models.family.ModelFamily`;
- :mod:`.export`: ``crosstrain export --format hf`` through ``save_pretrained``.

transformers is imported only when a generic model is built (the ``hf`` extra).
"""
