"""The models built from plainformer's blocks: one module per family."""

from .bert import BertConfig, BertForMaskedLM, BertForSequenceClassification, BertModel
from .gpt import GPT, GPTConfig
from .transformer import Transformer, TransformerConfig

__all__ = ["GPT", "BertConfig", "BertForMaskedLM", "BertForSequenceClassification", "BertModel", "GPTConfig",
           "Transformer", "TransformerConfig"]
