"""The models built from plainformer's blocks: one module per family."""

from .gpt import GPT, GPTConfig
from .bert import BertConfig, BertForMaskedLM, BertForSequenceClassification, BertModel
from .transformer import Transformer, TransformerConfig
