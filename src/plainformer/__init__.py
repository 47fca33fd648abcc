"""plainformer: the Transformer from first principles, exact, fast and readable next to the paper.

    import plainformer as pf
"""

from ._version import __version__ as __version__
from .checkpoint.format import Checkpoint, CheckpointError, load_checkpoint, save_checkpoint
from .config import Config
from .data.corpus import TextSplit, Work, load_split, load_text, split_text
from .data.lm import LMBatchSource, build_tokenizer, token_array
from .data.prepared import LMData, prepare_lm_data
from .data.seq2seq import Seq2SeqBatches, make_task, train_tokenizer
from .data.tokenizers import (
    BPETokenizer,
    CharTokenizer,
    Tokenizer,
    WordPieceTokenizer,
    load_tokenizer,
)
from .explorer.page import attention_data, attention_html
from .families import load_model
from .generation.beam_search import beam_search
from .generation.decoding import generate, iter_generate
from .generation.sampling import sample_next
from .gguf.writer import save_gguf
from .hf.auto import load_hf, save_hf
from .hf.bert import load_hf_bert, save_hf_bert
from .hf.lora import load_lora, save_lora
from .hf.sentence import SentenceEncoder
from .hf.tokenizer_files import load_hf_tokenizer, save_hf_tokenizer
from .inference.prepack import PackedLinear, prepack
from .inference.quantize import Int8Linear, quantize
from .models import (
    GPT,
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
    BertModel,
    GPTConfig,
    Transformer,
    TransformerConfig,
)
from .models.attention_maps import all_attention_maps, attention_maps, plot_attention_maps
from .models.gpt import Block
from .nn.attention import MultiHeadAttention, attention, scaled_dot_product_attention
from .nn.blocks import Decoder, DecoderCache, DecoderLayer, Encoder, EncoderLayer
from .nn.feedforward import FeedForward
from .nn.flash import flash_attention
from .nn.kv_cache import KVCache
from .nn.lora import LoRAConfig, LoRALinear, add_lora, lora_parameters, merge_lora, unload_lora, unmerge_lora
from .nn.masks import causal_mask
from .nn.moe import MoEFeedForward, load_balancing_loss, router_z_loss
from .nn.normalization import RMSNorm
from .nn.positional import LearnedPositionalEmbedding, SinusoidalPositionalEncoding
from .nn.rope import RotaryEmbedding
from .training.config import TrainConfig
from .training.optim import lr_at, make_optimizer
from .training.plots import plot_loss_curve
from .training.trainer import Trainer, TrainingInterrupted

__all__ = [
    "BPETokenizer",
    "BertConfig",
    "BertForMaskedLM",
    "BertForSequenceClassification",
    "BertModel",
    "Block",
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
    "Int8Linear",
    "KVCache",
    "LoRAConfig",
    "LoRALinear",
    "LMBatchSource",
    "LMData",
    "LearnedPositionalEmbedding",
    "MoEFeedForward",
    "MultiHeadAttention",
    "PackedLinear",
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
    "add_lora",
    "all_attention_maps",
    "attention",
    "attention_data",
    "attention_html",
    "attention_maps",
    "beam_search",
    "build_tokenizer",
    "causal_mask",
    "flash_attention",
    "generate",
    "iter_generate",
    "load_checkpoint",
    "load_hf",
    "load_balancing_loss",
    "load_hf_bert",
    "load_hf_tokenizer",
    "load_lora",
    "load_model",
    "load_split",
    "load_text",
    "load_tokenizer",
    "lora_parameters",
    "lr_at",
    "make_optimizer",
    "make_task",
    "merge_lora",
    "plot_attention_maps",
    "plot_loss_curve",
    "prepack",
    "prepare_lm_data",
    "quantize",
    "router_z_loss",
    "sample_next",
    "save_checkpoint",
    "save_gguf",
    "save_hf",
    "save_hf_bert",
    "save_hf_tokenizer",
    "save_lora",
    "scaled_dot_product_attention",
    "split_text",
    "token_array",
    "train_tokenizer",
    "unload_lora",
    "unmerge_lora",
]
