"""Optimizers and learning-rate schedules (``factory.build_optimizer``, ``schedules.build_schedule``)."""
