"""Checkpoints: the model registry (models.yaml), the seeded-weight builder, the loader and the
tokenizer. Turns a name or folder into architecture numbers, weights and a tokenizer; imports
nothing from the other layers except `runtime.model` (weight names) and `engine.paths`."""
