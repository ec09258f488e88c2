"""A training step and its memory: the tracker, ``measure_step``, the step every lab toggles,
short training runs and batching. Mechanisms: they import the core and the estimate."""
