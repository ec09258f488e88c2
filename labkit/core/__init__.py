"""The core: the vocabulary (every choice list once), bytes and units, model configurations and
presets, ``Recipe`` and ``Layout``. Torch-free; imports nothing else of labkit."""
