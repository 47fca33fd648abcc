"""Every model family, registered once: the CLI, `eval`, `export`, `attention`, the recipes and the tests
look a family up here by the name its checkpoints carry.

A new family is one module beside these (its `Family`: model and config classes, data-decided fields,
recipe options, train, evaluate, Hugging Face export) and one entry in `FAMILIES`.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..checkpoint.format import load_checkpoint
from ..hf.auto import load_hf
from ..hf.directory import is_hf_directory
from ..models.family_model import FamilyModel
from .bert import BERT_FAMILY, BERT_MLM_FAMILY
from .classifier import BERT_CLS_FAMILY
from .family import Family, checkpoint_dir, refuse_non_model
from .finetuning import load_trained
from .gpt import GPT_FAMILY
from .transformer import TRANSFORMER_FAMILY

FAMILIES: dict[str, Family] = {family.name: family for family in (
    GPT_FAMILY, BERT_FAMILY, BERT_MLM_FAMILY, BERT_CLS_FAMILY, TRANSFORMER_FAMILY)}


def get(name: str) -> Family:
    """The family checkpoints call `name`; a ValueError naming the known ones otherwise."""
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; plainformer knows {', '.join(FAMILIES)}")
    return FAMILIES[name]


def trained() -> list[Family]:
    """The families that recipes train, in registry order."""
    return [family for family in FAMILIES.values() if family.train is not None]


def load_model(path: str | os.PathLike) -> FamilyModel:
    """The model, in eval mode with its tokenizer as `.tokenizer`, of a plainformer checkpoint or run
    directory (its best/, else last/; a LoRA run's adapter on the base it names, checked by sha256) or of
    a Hugging Face GPT-2, Llama or BERT directory. Its family: `get(model.family)`."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no model at {path}: the directory does not exist")
    if is_hf_directory(path):
        return load_hf(path)
    directory = checkpoint_dir(path)
    if directory == path:
        refuse_non_model(path)
    checkpoint = load_checkpoint(directory)
    if checkpoint.family not in FAMILIES:
        raise ValueError(f"{checkpoint.path} holds a {checkpoint.family!r} model; plainformer knows "
                         f"{', '.join(FAMILIES)}")
    return load_trained(checkpoint, FAMILIES[checkpoint.family])

