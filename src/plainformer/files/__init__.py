"""The bottom layer for files: atomic writes of a file or a directory (one temporary-name scheme, one
sweep of stale temporaries), the run lock, and the one reader of JSON-object files."""
