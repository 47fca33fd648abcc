"""Encoder-decoder Transformer: training throughput against torch.nn.Transformer, and translation
quality on the default task after `plainformer train --preset seq2seq-numbers-en-fr` (issue 5).

    python benchmarks/seq2seq.py [--presets small base] [--repeats 5] [--steps 10] [--threads 1]
                                 [--skip-quality] [--out DIR]

Throughput. One training step = forward with label-smoothed loss, backward, optimizer update and
zero_grad, on batches of the default task (`numbers-en-fr`, 64 sentence pairs grouped by length) with
the default model shape (preset `small`; `--presets` adds others, e.g. the paper's `base`). The peer is
torch's nn.Transformer (batch_first, post-LN, relu, no final norms, as the paper and ours) between the
same embedding (scaled by √d_model, plus the sinusoidal table) and the tied output projection, given the
same source, target and memory padding masks and causal mask (its layers keep torch's initialisation:
speed does not depend on the weights). Both use the optimizer our trainer builds
(`training.make_optimizer`: fused AdamW, β = (0.9, 0.98), ε = 1e-9, no weight decay) and run the same
batches, interleaved (who goes first alternates) in this one process, after a warm-up; medians of the
rounds are quoted. tokens = source + target tokens that are not padding. ratio = ours / peer in tokens/s
(higher is better; the issue's target is >= 1.0).

Quality. `plainformer train --preset seq2seq-numbers-en-fr` (model preset small) into --out,
then `plainformer eval` of that run on the test split, greedy and with beam 4 (α = 0.6):
corpus BLEU (sacrebleu) and exact match. Wall and CPU seconds of training are both given: on a machine
shared with other work, CPU seconds are what 2 idle cores would need (the run uses one thread).
Output: a table, then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from plainformer import recipes
from plainformer.cli import build_parser
from plainformer.data.seq2seq import Seq2SeqBatches, make_task, train_tokenizer
from plainformer.models.transformer import Transformer, TransformerConfig, label_smoothed_cross_entropy
from plainformer.training.optim import make_optimizer

TASK = "numbers-en-fr"
RECIPE = recipes.get(f"seq2seq-{TASK}")
RECIPE_PRESET = next(name for name in TransformerConfig.preset_names()
                     if TransformerConfig.from_preset(name) == RECIPE.model)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", choices=TransformerConfig.preset_names(),
                        default=[RECIPE_PRESET],
                        help="model shapes to time (default: the default task's)")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per model")
    parser.add_argument("--steps", type=int, default=10, help="training steps per round")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default: 1, "
                                                              "as the seq2seq recipes)")
    parser.add_argument("--skip-quality", action="store_true", help="throughput only")
    parser.add_argument("--out", type=Path, help="run directory of the quality run (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.steps < 1:
        parser.error("--repeats and --steps must be positive")
    return args


# ----------------------------------------------------------------------------- throughput

class TorchPeer(nn.Module):
    """nn.Transformer of `model`'s shape between a copy of its embedding (× √d_model + PE) and the
    tied output projection."""

    def __init__(self, model: Transformer):
        super().__init__()
        c = self.config = model.config
        layer = dict(d_model=c.d_model, nhead=c.n_heads, dim_feedforward=c.d_ff, dropout=c.dropout,
                     batch_first=True)
        encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(**layer), c.encoder_layers,
                                        enable_nested_tensor=False)
        decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(**layer), c.decoder_layers)
        self.body = nn.Transformer(d_model=c.d_model, nhead=c.n_heads, batch_first=True,
                                   custom_encoder=encoder, custom_decoder=decoder)
        self.embedding = copy.deepcopy(model.encoder.embedding)
        self.register_buffer("pe", model.encoder.positional.pe.clone(), persistent=False)

    def forward(self, src: Tensor, tgt_in: Tensor, tgt_out: Tensor) -> tuple[Tensor, Tensor]:
        pad, scale, n = self.config.pad_id, math.sqrt(self.config.d_model), tgt_in.shape[1]
        x = self.embedding(src) * scale + self.pe[:src.shape[1]]
        y = self.embedding(tgt_in) * scale + self.pe[:n]
        causal = torch.ones(n, n, dtype=torch.bool).triu(1)  # True = masked, torch's convention
        h = self.body(x, y, tgt_mask=causal, tgt_is_causal=True, src_key_padding_mask=src == pad,
                      tgt_key_padding_mask=tgt_in == pad, memory_key_padding_mask=src == pad)
        logits = h @ self.embedding.weight.T
        return logits, label_smoothed_cross_entropy(logits, tgt_out, self.config.label_smoothing, pad)


def _training_round(model: nn.Module, optimizer: torch.optim.Optimizer,
                    batches: list[dict[str, Tensor]]) -> Callable[[], float]:
    def run() -> float:
        start = time.perf_counter()
        for batch in batches:
            _, loss = model(**batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start
    return run


def throughput(args: argparse.Namespace, preset: str) -> dict[str, Any]:
    task = make_task(TASK, sizes={"train": 4000})
    tokenizer = train_tokenizer(task)
    source = Seq2SeqBatches(task, tokenizer)
    batch_size = RECIPE.train.batch_size
    batches = [source.get_batch("train", i, batch_size) for i in range(args.steps)]
    tokens = sum(int((b["src"] != tokenizer.pad_id).sum() + (b["tgt_out"] != tokenizer.pad_id).sum())
                 for b in batches)
    config = TransformerConfig.from_preset(
        preset, src_vocab_size=tokenizer.vocab_size, tgt_vocab_size=tokenizer.vocab_size,
        pad_id=tokenizer.pad_id, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id)
    torch.manual_seed(0)
    ours = Transformer(config)
    peer = TorchPeer(ours)
    recipe = RECIPE.train.replace(schedule_d_model=config.d_model)
    rounds = {"ours": _training_round(ours, make_optimizer(ours, recipe), batches),
              "peer": _training_round(peer, make_optimizer(peer, recipe), batches)}
    for run in rounds.values():
        run()  # warm-up
    seconds: dict[str, list[float]] = {"ours": [], "peer": []}
    for repeat in range(args.repeats):
        for name in (("ours", "peer") if repeat % 2 == 0 else ("peer", "ours")):
            seconds[name].append(rounds[name]())
    rates = {name: tokens / statistics.median(times) for name, times in seconds.items()}
    return {"preset": preset, "shape": {k: getattr(config, k) for k in ("n_layers", "d_model", "n_heads", "d_ff")},
            "vocab_size": config.src_vocab_size, "batch_size": batch_size, "tokens_per_round": tokens,
            "ours_tokens_per_s": rates["ours"], "peer_tokens_per_s": rates["peer"],
            "ratio": rates["ours"] / rates["peer"]}


# ----------------------------------------------------------------------------- quality

def _cli(*argv: str) -> dict[str, Any]:
    """Run a `plainformer` command in this process; its metrics."""
    args = build_parser().parse_args(list(argv))
    return args.run(args)


def quality(out: Path) -> dict[str, Any]:
    wall, cpu = time.perf_counter(), time.process_time()
    trained = _cli("train", "--preset", RECIPE.name, "--out", str(out), "--no-progress")
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    greedy = _cli("eval", "--ckpt", str(out), "--beam", "1")
    beam = _cli("eval", "--ckpt", str(out), "--beam", "4")
    return {"task": trained["task"], "steps": trained["step"], "parameters": trained["parameters"],
            "train_wall_s": wall, "train_cpu_s": cpu, "greedy": greedy, "beam4": beam}


# ----------------------------------------------------------------------------- report

def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    speeds = [throughput(args, preset) for preset in args.presets]
    rows = [(f"training tokens/s, {s['preset']} ({s['shape']['n_layers']}+{s['shape']['n_layers']} layers, "
             f"d_model {s['shape']['d_model']}, batch {s['batch_size']})",
             f"{s['ours_tokens_per_s']:,.0f}", f"{s['peer_tokens_per_s']:,.0f}", f"{s['ratio']:.2f}x")
            for s in speeds]
    result: dict[str, Any] = {"benchmark": "seq2seq", "threads": torch.get_num_threads(), "throughput": speeds}
    if not args.skip_quality:
        with tempfile.TemporaryDirectory() as tmp:
            result["quality"] = q = quality(args.out or Path(tmp) / "run")
        rows += [(f"train `--preset seq2seq-{TASK}` ({q['task']}, {q['steps']} steps)",
                  f"{q['train_wall_s']:.0f} s wall, {q['train_cpu_s']:.0f} s CPU", "-", "-")]
        for name, label in (("greedy", "greedy"), ("beam4", "beam 4, α=0.6")):
            scores = q[name]
            rows.append((f"test {label}: exact match / BLEU",
                         f"{scores['exact_match']:.2%} / {scores['bleu']:.2f}", "-", "-"))
            rows.append((f"test {label}: sentences/s", f"{scores['sentences_per_s']:.0f}", "-", "-"))
    print(f"seq2seq benchmark, {torch.get_num_threads()} thread(s), median of {args.repeats} rounds of "
          f"{args.steps} steps; ratio = ours / peer tokens/s (higher is better); peer = torch.nn.Transformer")
    widths = [max(len(row[i]) for row in rows + [("what", "ours", "peer", "ratio")]) for i in range(4)]
    for row in [("what", "ours", "peer", "ratio"), *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    print(json.dumps(result, sort_keys=True))


if __name__ == "__main__":
    main()
