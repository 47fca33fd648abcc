"""Every model family, registered once: the CLI, `eval`, `export`, `attention`, the recipes and the tests
look a family up here by the name its checkpoints carry.

A new family is one module beside these (its `Family`: model and config classes, data-decided fields,
recipe options, train, evaluate, Hugging Face export) and one entry in `FAMILIES`.
"""

from __future__ import annotations

from .bert import BERT_CLS_FAMILY, BERT_FAMILY, BERT_MLM_FAMILY
from .family import Family
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
