"""Files: the checkpoint format, Hugging Face adapters, and the one atomic-write helper.

Import the modules themselves (`plainformer.io.checkpoint`, ...): this package imports nothing at
load time, so the data layer can use `io.atomic` without pulling in the model adapters.
"""
