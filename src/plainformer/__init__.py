"""plainformer: the Transformer from first principles, exact, fast and readable next to the paper.

    import plainformer as pf
"""

from importlib.metadata import PackageNotFoundError, version

from .attention import MultiHeadAttention, attention, causal_mask, scaled_dot_product_attention
from .checkpoint import Checkpoint, CheckpointError, load_checkpoint, save_checkpoint
from .config import Config
from .data import (LMBatchSource, LMData, TextSplit, Work, build_tokenizer, load_split, load_text,
                   prepare_lm_data, split_text, token_array)
from .decoder import Decoder, DecoderCache, DecoderLayer
from .feedforward import FeedForward
from .flash import flash_attention
from .generation import beam_search, generate, iter_generate, sample_next
from .interop import load_hf_bert, save_hf_bert
from .kv_cache import KVCache
from .layers import Encoder, EncoderLayer
from .models import (GPT, BertConfig, BertForMaskedLM, BertForSequenceClassification, BertModel,
                     GPTConfig, Transformer, TransformerConfig)
from .normalization import RMSNorm
from .positional import LearnedPositionalEmbedding, SinusoidalPositionalEncoding
from .rope import RotaryEmbedding
from .sentence import SentenceEncoder
from .tasks import Seq2SeqBatches, make_task, train_tokenizer
from .tokenizers import BPETokenizer, CharTokenizer, Tokenizer, WordPieceTokenizer, load_tokenizer
from .training import TrainConfig, Trainer, TrainingInterrupted, lr_at, make_optimizer
from .visualization import plot_loss_curve

try:
    __version__ = version("plainformer")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0"

__all__ = [
    "BPETokenizer",
    "BertConfig",
    "BertForMaskedLM",
    "BertForSequenceClassification",
    "BertModel",
    "CharTokenizer",
    "Checkpoint",
    "CheckpointError",
    "Config",
    "Decoder",
    "DecoderCache",
    "DecoderLayer",
    "Encoder",
    "EncoderLayer",
    "FeedForward",
    "GPT",
    "GPTConfig",
    "KVCache",
    "LMBatchSource",
    "LMData",
    "LearnedPositionalEmbedding",
    "MultiHeadAttention",
    "RMSNorm",
    "RotaryEmbedding",
    "SentenceEncoder",
    "Seq2SeqBatches",
    "SinusoidalPositionalEncoding",
    "TextSplit",
    "Tokenizer",
    "TrainConfig",
    "Trainer",
    "TrainingInterrupted",
    "Transformer",
    "TransformerConfig",
    "WordPieceTokenizer",
    "Work",
    "attention",
    "beam_search",
    "build_tokenizer",
    "causal_mask",
    "flash_attention",
    "generate",
    "iter_generate",
    "load_checkpoint",
    "load_hf_bert",
    "load_split",
    "load_text",
    "load_tokenizer",
    "lr_at",
    "make_optimizer",
    "make_task",
    "plot_loss_curve",
    "prepare_lm_data",
    "sample_next",
    "save_checkpoint",
    "save_hf_bert",
    "scaled_dot_product_attention",
    "split_text",
    "token_array",
    "train_tokenizer",
]
