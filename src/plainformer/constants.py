"""Values every layer agrees on."""

#: The target of a position no loss scores (torch's `cross_entropy(ignore_index=...)` default).
IGNORE_INDEX = -100
