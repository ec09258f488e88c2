"""A training step and its memory: the tracker, ``measure_step``, the step every lab toggles,
short training runs, padding and packing."""
