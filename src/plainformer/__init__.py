"""plainformer: the Transformer from first principles, exact, fast and readable next to the paper.

    import plainformer as pf
"""

from importlib.metadata import PackageNotFoundError, version

from .attention import MultiHeadAttention, attention, causal_mask, scaled_dot_product_attention
from .checkpoint import Checkpoint, CheckpointError, load_checkpoint, save_checkpoint
from .config import Config
from .feedforward import FeedForward
from .kv_cache import KVCache
from .data import (LMBatchSource, LMData, TextSplit, Work, build_tokenizer, load_split, load_text,
                   prepare_lm_data, split_text, token_array)
from .flash import flash_attention
from .generation import generate, iter_generate, sample_next
from .layers import Encoder, EncoderLayer
from .interop import load_hf_bert, save_hf_bert
from .models import GPT, GPTConfig
from .models.bert import BertConfig, BertForMaskedLM, BertForSequenceClassification, BertModel
from .sentence import SentenceEncoder
from .normalization import RMSNorm
from .positional import LearnedPositionalEmbedding, SinusoidalPositionalEncoding
from .rope import RotaryEmbedding
from .training import TrainConfig, Trainer, TrainingInterrupted, lr_at, make_optimizer
from .visualization import plot_loss_curve
from .tokenizers import BPETokenizer, CharTokenizer, Tokenizer, WordPieceTokenizer, load_tokenizer

try:
    __version__ = version("plainformer")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0"

__all__ = [
    "flash_attention",
    "BertConfig",
    "BertForMaskedLM",
    "BertForSequenceClassification",
    "BertModel",
    "SentenceEncoder",
    "load_hf_bert",
    "save_hf_bert",
    "Checkpoint",
    "CheckpointError",
    "load_checkpoint",
    "save_checkpoint",
    "TrainConfig",
    "Trainer",
    "TrainingInterrupted",
    "lr_at",
    "make_optimizer",
    "plot_loss_curve",
    "BPETokenizer",
    "CharTokenizer",
    "LMBatchSource",
    "LMData",
    "TextSplit",
    "Tokenizer",
    "Work",
    "WordPieceTokenizer",
    "build_tokenizer",
    "load_split",
    "load_text",
    "load_tokenizer",
    "prepare_lm_data",
    "split_text",
    "token_array",
    "Config",
    "Encoder",
    "EncoderLayer",
    "FeedForward",
    "GPT",
    "GPTConfig",
    "KVCache",
    "LearnedPositionalEmbedding",
    "MultiHeadAttention",
    "RMSNorm",
    "RotaryEmbedding",
    "SinusoidalPositionalEncoding",
    "attention",
    "causal_mask",
    "generate",
    "iter_generate",
    "sample_next",
    "scaled_dot_product_attention",
]
