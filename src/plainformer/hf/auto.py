"""`save_hf(model, directory)` and `load_hf(directory)`: any model of a family with a Hugging Face layout.

The one place that tells the families apart: a model goes to its family's module by its class (a GPT to
`hf.gpt`, a BertModel or BertForSequenceClassification to `hf.bert`, a translation Transformer to `hf.marian`),
a directory by its config.json's model_type ('bert' to `hf.bert`, as a classifier where its architectures say
so; 'marian' to `hf.marian`; any other to `hf.gpt`, which names the model types it reads). The tokenizer of a
GPT or a BERT goes beside the weights as tokenizer.json + tokenizer_config.json, the files
`AutoTokenizer.from_pretrained` reads; `load_hf` also takes an older GPT-2 directory's tokenizer as vocab.json
+ merges.txt alone, and a BERT directory's as vocab.txt. A Marian directory's tokenizer is MarianTokenizer's
own files (`hf.marian`).
"""

from __future__ import annotations

import os
from pathlib import Path

from ..data.tokenizers import TOKENIZER_FILE, Tokenizer
from ..models.bert import BertForSequenceClassification, BertModel
from ..models.gpt import GPT
from ..models.transformer import Transformer
from .bert import is_bert_classifier, load_hf_bert, load_hf_bert_classifier, load_hf_bert_tokenizer, save_hf_bert
from .directory import read_hf_config
from .gpt import read_gpt_directory, write_gpt_directory
from .marian import load_marian, save_marian
from .tokenizer_files import has_gpt2_files, load_hf_tokenizer, save_hf_tokenizer

HFModel = GPT | BertModel | BertForSequenceClassification
MARIAN = "marian"  # config.json's model_type of a Marian directory (transformers' MarianMTModel, opus-mt)


def save_hf(model: HFModel | Transformer, directory: str | os.PathLike, *,
            tokenizer: Tokenizer | None = None) -> Path:
    """Write `model` as a Hugging Face directory that `AutoModelForCausalLM.from_pretrained` (a GPT) or
    `BertModel.from_pretrained` loads, with `tokenizer` (default: `model.tokenizer`) as tokenizer.json +
    tokenizer_config.json for `AutoTokenizer`. Rows of a vocabulary padded past the tokenizer's are
    cropped. Every file is written atomically."""
    tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    if isinstance(model, Transformer):
        return save_marian(model, directory, tokenizer=tokenizer)
    if isinstance(model, (BertModel, BertForSequenceClassification)):
        directory = save_hf_bert(model, directory)
    elif isinstance(model, GPT):
        directory = write_gpt_directory(model, directory, tokenizer)
    else:
        raise TypeError(f"model must be a GPT, a BertModel, a BertForSequenceClassification or a Transformer, "
                        f"got {type(model).__name__}")
    if tokenizer is not None:
        save_hf_tokenizer(tokenizer, directory, model_max_length=_max_len(model))
    return directory


def _max_len(model: HFModel) -> int:
    return model.config.block_size if isinstance(model, GPT) else model.config.max_len


def load_hf(directory: str | os.PathLike, *, backend: str = "auto") -> HFModel | Transformer:
    """The model of a Hugging Face GPT-2, Llama, Mixtral, BERT, BertForSequenceClassification or Marian
    directory, in eval mode, with its tokenizer (if the directory has one: tokenizer.json, GPT-2's vocab.json +
    merges.txt, BERT's vocab.txt, Marian's source.spm + target.spm + vocab.json) as `.tokenizer`."""
    directory = Path(directory)
    hf = read_hf_config(directory)
    if hf.get("model_type") == MARIAN:
        return load_marian(directory, backend=backend)
    model: HFModel
    if is_bert_classifier(hf):
        model = load_hf_bert_classifier(directory, backend=backend)
    elif hf.get("model_type") == "bert":
        model = load_hf_bert(directory, backend=backend)
    else:
        model = read_gpt_directory(directory, hf, backend=backend)
    model.tokenizer = _read_tokenizer(directory, hf.get("model_type"))
    return model


def hf_family(directory: str | os.PathLike) -> str:
    """The family of the model in a Hugging Face directory, as `load_hf` would build it, from its config.json."""
    hf = read_hf_config(directory)
    if is_bert_classifier(hf):
        return BertForSequenceClassification.family
    if hf.get("model_type") == MARIAN:
        return Transformer.family
    return BertModel.family if hf.get("model_type") == "bert" else GPT.family


def _read_tokenizer(directory: Path, model_type: str | None) -> Tokenizer | None:
    if (directory / TOKENIZER_FILE).is_file() or has_gpt2_files(directory):
        return load_hf_tokenizer(directory)
    if model_type == "bert" and (directory / "vocab.txt").is_file():
        return load_hf_bert_tokenizer(directory)
    return None
