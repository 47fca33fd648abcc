"""The one checkpoint format of every model family (`format`), below the models that load from it:
safetensors and JSON with a manifest, the optimizer's state (`optimizer_state`) and the random streams
(`rng`) of a training run."""
