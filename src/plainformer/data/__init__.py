"""Data: the bundled corpus and its split, tokenizers, LM and MLM batches, seq2seq and classification tasks."""
