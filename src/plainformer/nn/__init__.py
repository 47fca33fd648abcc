"""Building blocks, one module per concept: attention, positions, feed-forward, norms, the layer stacks.

Nothing here imports from the rest of the package but the base modules (`_checks`, `config`): not
`files/`, and no layer above (inference, data, generation, checkpoint, models, hf, training, families,
cli).
"""

from .attention import MultiHeadAttention, attention, scaled_dot_product_attention
from .blocks import Decoder, DecoderCache, DecoderLayer, Encoder, EncoderLayer
from .feedforward import FeedForward
from .flash import flash_attention
from .kv_cache import KVCache
from .masks import AttentionMask, causal_mask
from .modes import eval_mode
from .moe import MoEFeedForward, load_balancing_loss, router_z_loss
from .normalization import RMSNorm
from .positional import LearnedPositionalEmbedding, SinusoidalPositionalEncoding
from .rope import RotaryEmbedding

__all__ = [
    "AttentionMask", "Decoder", "DecoderCache", "DecoderLayer", "Encoder", "EncoderLayer", "FeedForward", "KVCache",
    "LearnedPositionalEmbedding", "MoEFeedForward", "MultiHeadAttention", "RMSNorm", "RotaryEmbedding",
    "SinusoidalPositionalEncoding", "attention", "causal_mask", "eval_mode", "flash_attention",
    "load_balancing_loss", "router_z_loss", "scaled_dot_product_attention",
]
