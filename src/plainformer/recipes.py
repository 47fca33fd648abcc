"""Every named training recipe, for every model family, in one place.

A recipe is what `plainformer train --recipe NAME` runs: the model family, the model config, the
`TrainConfig`, and the family's data options (tokenizer, task, sequence length, ...). Options given on
the command line or in a `--config` file override its fields one by one.

    from plainformer import recipes
    recipe = recipes.get("seq2seq-copy")
    recipe.family, recipe.model.d_model, recipe.train.lr, recipe.options["task"]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from . import families
from .config import Config
from .models.bert import BertConfig
from .models.gpt import GPTConfig
from .models.transformer import TransformerConfig
from .training.config import TrainConfig


@dataclasses.dataclass(frozen=True)
class Shape:
    """One of a recipe's measured shapes, for machines whose training matmuls (in the dtype the run trains
    in) run at `min_gflops` or faster: its changes to the recipe's model config and TrainConfig."""

    name: str
    min_gflops: float
    model: Mapping[str, Any]
    train: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class Recipe:
    """name -> (family, as `families` registers it; model config, TrainConfig, data options). `model` is
    None when the model comes from the `init` option (fine-tuning a pretrained one). A recipe with
    `shapes` (fastest machines first, the last one for any) trains the first shape the machine's measured
    matmul rate reaches (`shaped_for`), unless one of the fields the shapes set is given (`shape_fields`)."""

    name: str
    family: str
    model: Config | None
    train: TrainConfig
    options: Mapping[str, Any]
    summary: str
    shapes: tuple[Shape, ...] = ()

    def __post_init__(self) -> None:
        family = families.get(self.family)
        if family.train is None or not isinstance(self.model, (family.config, type(None))):
            raise ValueError(f"recipe {self.name!r}: family {self.family!r} trains a {family.config.__name__}, "
                             f"got {type(self.model).__name__}")
        rates = [shape.min_gflops for shape in self.shapes]
        if rates and (rates != sorted(rates, reverse=True) or rates[-1] != 0):
            raise ValueError(f"recipe {self.name!r}: shapes go from the fastest machines' to one for any "
                             f"(min_gflops 0), got min_gflops {rates}")

    def shape_fields(self) -> set[str]:
        """The model and TrainConfig fields that some shape sets."""
        return {name for shape in self.shapes for name in (*shape.model, *shape.train)}

    def shape_for(self, gflops: float) -> Shape:
        """The first of `shapes` whose min_gflops `gflops` reaches."""
        return next(shape for shape in self.shapes if gflops >= shape.min_gflops)

    def rates_taking(self, shape: Shape) -> str:
        """The matmul rates this recipe takes `shape` at: "from 250 GFLOP/s", and for the last shape (any
        machine's) "below" the one before it."""
        if shape.min_gflops:
            return f"from {shape.min_gflops:g} GFLOP/s"
        faster = [other.min_gflops for other in self.shapes if other.min_gflops]
        return f"below {min(faster):g} GFLOP/s" if faster else "at any rate"

    def shaped_for(self, gflops: float) -> tuple[Shape, Recipe]:
        """The shape for a machine multiplying at `gflops`, and this recipe with its changes made."""
        shape = self.shape_for(gflops)
        assert self.model is not None, "a fine-tuning recipe takes its shape from `init`"
        return shape, dataclasses.replace(self, model=self.model.replace(**shape.model),
                                          train=self.train.replace(**shape.train), shapes=())


def _gpt(name: str, summary: str, **train: Any) -> Recipe:
    return Recipe(name, "gpt", GPTConfig.from_preset(name), TrainConfig(**train),
                  {"tokenizer": "char"}, summary)


def _seq2seq(task: str, model_preset: str, train: TrainConfig, summary: str) -> Recipe:
    # The small models run faster on one thread than on two shared cores: intra-op parallelism
    # cannot pay for its synchronisation on ops this small (see benchmarks/seq2seq.py).
    return Recipe(f"seq2seq-{task}", "transformer", TransformerConfig.from_preset(model_preset), train,
                  {"task": task, "threads": 1}, summary)


# The symbol tasks learn fastest with a short cosine schedule and Adam(0.9, 0.98, 1e-9), chosen by
# experiment: `copy` is copied exactly after 900 steps.
_SYMBOL_TRAINING = TrainConfig(
    schedule="cosine", lr=7e-3, min_lr=1e-4, warmup_steps=50, max_steps=900, batch_size=64, beta1=0.9,
    beta2=0.98, eps=1e-9, weight_decay=0.0, grad_clip=0.0, eval_interval=0, save_interval=0,
    eval_batches=4, log_interval=50)

# The `default` GPT's recipe, chosen by experiment (docs/guide.md, "Choosing the default"): Muon for the blocks'
# matrices at batch 16, as many steps as end by DEFAULT_TRAINING_SECONDS on the machine at hand; the
# validation estimate reads 40 batches of 16 rows (81,920 tokens). It evaluates every 1,000 steps (besides the
# planner's one and the last): every 200 cost 11 of a 203 s run's seconds (issue 38: outside the steps <= 5%).
DEFAULT_TRAINING_SECONDS = 200.0
_DEFAULT_TRAINING = dict(batch_size=16, optimizer="muon", muon_lr=0.02, lr=2e-3, min_lr=1e-4, warmup_steps=30,
                         beta2=0.99, weight_decay=0.1, grad_clip=1.0, eval_interval=1000, eval_batches=40)

# The default's shapes, by the machine's matmul rate in the dtype it trains in (1024^3 products): 4 x 256
# where a 200 s run fits well over the ~600 steps it needs, 3 x 128 below, where it learned more in 200 s than
# any other shape tried (the measurements: docs/experiments.md, "The shape").
_DEFAULT_SHAPES = (Shape("4x256", 600.0, {}, {}),
                   Shape("3x128", 0.0, dict(n_layers=3, d_model=128, d_ff=344), {}))

# Translating Multi30k on 2 cores in 30 minutes (docs/experiments.md, "Multi30k"): a post-LN model of the paper's
# shape, 3 + 3 layers at half its width and a quarter of its FFN, one SentencePiece vocabulary of 6,000 pieces, the
# paper's optimizer and inverse-sqrt schedule (its peak scaled by 0.25, warmup 200 steps), label smoothing 0.1,
# batches of ~2,000 tokens a side (more updates an epoch than the paper's 25,000 learn more in a short run); as
# many steps as end by 29 minutes, best/ by validation BLEU, then the last 5 checkpoints (50 steps apart) averaged.
# The data is yours to name: --data DIR/train --val-data DIR/val.
_MULTI30K_MODEL: dict[str, Any] = dict(n_layers=3, d_model=256, n_heads=4, d_ff=512, dropout=0.1,
                                       attention_dropout=0.0, activation_dropout=0.0, label_smoothing=0.1, max_len=128)
_MULTI30K_TRAINING = TrainConfig.from_preset(
    "transformer-paper", lr=0.25, schedule_d_model=256, warmup_steps=200, max_steps=20_000, max_time=1740.0,
    batch_size=512, eval_interval=400, eval_batches=8, save_interval=50, keep_checkpoints=5, log_interval=50,
    dtype="float32")


def _translation(name: str, source_lang: str, target_lang: str, summary: str) -> Recipe:
    return Recipe(name, "transformer", TransformerConfig(**_MULTI30K_MODEL), _MULTI30K_TRAINING,
                  {"source_lang": source_lang, "target_lang": target_lang, "vocab_size": 6000, "batch_tokens": 2048},
                  summary)


def _paper(name: str, preset: str, summary: str) -> Recipe:
    """The paper's models (Table 3) and training (section 5): 37,000 shared pieces, 25,000 tokens a side."""
    model = TransformerConfig.from_preset(preset, max_len=256)
    train = TrainConfig.from_preset("transformer-paper", batch_size=4096, eval_interval=1000, save_interval=1000,
                                    keep_checkpoints=5, schedule_d_model=model.d_model)
    return Recipe(name, "transformer", model, train, {"vocab_size": 37000, "batch_tokens": 25000}, summary)

# SST-2 from MiniLM, whole-model fine-tuning in float32 (bf16 is slow where AVX2 is all there is) for as many
# steps as end by max_time, the schedule annealed by then (fit_to_time); the batches, grouped by length, pad
# little. The reasoning behind the values: docs/guide.md, "Classifying your own data".
_SST2_TRAINING = TrainConfig(
    max_steps=3000, max_time=14 * 60.0, fit_to_time=True, batch_size=32, lr=1e-4, min_lr=0.0, schedule="linear",
    warmup_steps=60, weight_decay=0.01, beta2=0.999, grad_clip=1.0, eval_interval=0, save_interval=0,
    eval_batch_size=128, dtype="float32", log_interval=20)

_RECIPES = [
    dataclasses.replace(
        _gpt("default", "GPT, 3.2M parameters (0.6M on a slower CPU), character-level Shakespeare in under 5 "
                        "minutes on 2 cores (docs/guide.md, 'Choosing the default')",
             max_steps=5000, max_time=DEFAULT_TRAINING_SECONDS, fit_to_time=True, **_DEFAULT_TRAINING),
        shapes=_DEFAULT_SHAPES),
    # The same recipe for a fixed number of steps (about the default's on 2 cores), so that the sparse
    # model compares with the dense one step for step.
    _gpt("moe", "the default GPT with 8 SwiGLU experts of half the width, 2 active per token (docs/guide.md, "
                "'Mixture of Experts')", max_steps=400, **_DEFAULT_TRAINING),
    _gpt("nanogpt-cpu", "nanoGPT's CPU recipe for Shakespeare characters (its README, "
                        "'I only have a macbook')",
         max_steps=2000, batch_size=12, lr=1e-3, min_lr=1e-4, warmup_steps=100, beta2=0.99,
         weight_decay=0.1, grad_clip=1.0, eval_interval=250, eval_batches=20),
    _gpt("shakespeare-char", "nanoGPT's config/train_shakespeare_char.py",
         max_steps=5000, batch_size=64, lr=1e-3, min_lr=1e-4, warmup_steps=100, beta2=0.99,
         weight_decay=0.1, grad_clip=1.0, eval_interval=250, eval_batches=200),
    # nanoGPT's config/train_gpt2.py: 12 x 1024 tokens x 40 accumulation steps (5 per GPU on 8).
    dataclasses.replace(
        _gpt("gpt2", "GPT-2 small (124M) with nanoGPT's config/train_gpt2.py; use --tokenizer bpe",
             max_steps=600_000, batch_size=12, grad_accum_steps=40, lr=6e-4, min_lr=6e-5,
             warmup_steps=2000, beta2=0.95, weight_decay=0.1, grad_clip=1.0, eval_interval=1000,
             eval_batches=200, save_interval=1000),
        options={"tokenizer": "bpe", "vocab_size": 50257}),
    # litgpt's finetune_lora learning rate and schedule, scaled down to runs of minutes; weight decay would
    # pull a LoRA's B (and a whole model) towards zero rather than towards the pretrained model.
    Recipe("gpt-finetune", "gpt", None,
           TrainConfig(max_steps=300, batch_size=16, lr=3e-4, min_lr=3e-5, warmup_steps=20, weight_decay=0.0,
                       beta2=0.999, grad_clip=1.0, eval_interval=100, save_interval=100, eval_batches=20),
           {}, "fine-tune a GPT (--init: ours, or a Hugging Face GPT-2 / Llama) on --data, whole or with --lora-r"),
    Recipe("bert-pretrain", "bert-mlm", BertConfig.from_preset("tiny"),
           TrainConfig(max_steps=1000, batch_size=32, lr=1e-3, min_lr=1e-4, warmup_steps=100,
                       weight_decay=0.01, beta2=0.999, eval_interval=250, eval_batches=10,
                       save_interval=250),
           {"vocab_size": 4096, "seq_len": 128},
           "BERT-tiny masked-LM pretraining on the bundled corpus, minutes on 2 cores"),
    Recipe("bert-finetune", "bert-cls", None,
           TrainConfig(max_steps=300, batch_size=32, lr=5e-5, min_lr=0.0, warmup_steps=30,
                       weight_decay=0.01, beta2=0.999, eval_interval=100, save_interval=100),
           {"init": "minilm", "seq_len": 64},
           "fine-tune a BERT (default: MiniLM) on your labelled --data, or to tell which of --plays a line is from"),
    # SST-2 (GLUE's sentiment) from MiniLM in 15 minutes on 2 cores: --data train.tsv --val-data val.tsv.
    Recipe("sst2", "bert-cls", None, _SST2_TRAINING, {"init": "minilm", "seq_len": 128},
           "fine-tune MiniLM on SST-2 (--data train.tsv --val-data val.tsv) within 15 minutes on 2 cores"),
    _seq2seq("copy", "tiny", _SYMBOL_TRAINING, "copy random symbol strings; exact in 900 steps"),
    _seq2seq("reverse", "tiny", _SYMBOL_TRAINING, "reverse random symbol strings"),
    # The paper's optimizer and schedule (section 5.3), warmup scaled down to runs of minutes.
    _seq2seq("numbers-en-fr", "small",
             TrainConfig.from_preset("transformer-paper", schedule_d_model=128, warmup_steps=400,
                                     max_steps=2000, batch_size=64, eval_interval=400,
                                     save_interval=400, eval_batches=8, log_interval=50),
             "English number words -> French with the paper's optimizer and schedule"),
    _translation("multi30k-de-en", "de", "en", "translate German to English: Multi30k (--data DIR/train --val-data "
                                               "DIR/val) in 30 minutes on 2 cores"),
    _translation("multi30k-en-de", "en", "de", "translate English to German: Multi30k in 30 minutes on 2 cores"),
    _paper("transformer-base", "base", "the paper's base model (65M) and training, on your --data (WMT-sized)"),
    _paper("transformer-big", "big", "the paper's big model (213M) and training, on your --data (WMT-sized)"),
]
RECIPES: Mapping[str, Recipe] = {recipe.name: recipe for recipe in _RECIPES}


def names(family: str | None = None) -> list[str]:
    """Recipe names, in registry order; only `family`'s when given."""
    return [name for name, recipe in RECIPES.items() if family is None or recipe.family == family]


def get(name: str) -> Recipe:
    if name not in RECIPES:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(RECIPES)}")
    return RECIPES[name]
