"""Checkpoints: :class:`crosstrain.checkpoint.manager.CheckpointManager` saves, resumes and prunes a run's
checkpoints through the active backend's :class:`crosstrain.checkpoint.dcp.DCPCheckpointer` (sharded DCP files
with an atomic, checksummed commit); see docs/checkpointing.md."""
