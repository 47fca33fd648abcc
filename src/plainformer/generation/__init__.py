"""Decoding: sampling the next token, the one autoregressive loop, beam search."""

from .beam_search import beam_search
from .decoding import IncrementalDecoder, generate, iter_generate
from .sampling import sample_next

__all__ = ["IncrementalDecoder", "beam_search", "generate", "iter_generate", "sample_next"]
