"""Translation speed on test2016 (issue 54): a trained run against transformers' MarianMTModel and CTranslate2 on
the same model (the run exported as a Marian directory), and training throughput against MarianMTModel.

    python benchmarks/translate.py --ckpt RUN [--threads 2] [--repeats 3] [--steps 10] [--quick]

Decoding: test2016's 1,000 German sources (PLAINFORMER_SHARED_DATA, default ../shared/data, multi30k), beam 4,
α = 0.6, text in and text out (tokenizing and detokenizing counted), each engine batching as it likes:
  ours           `Transformer.translate(beam_size=4, length_penalty=0.6)` (64 sources of similar length at a
                 time), on the kernels `plainformer translate` measures (`inference.measure_kernels`)
  ours int8      the same after `inference.quantize(model, "int8")`: every linear layer weight-only int8
  transformers   `MarianMTModel.generate(num_beams=4, length_penalty=0.6)` from the export, with
                 MarianTokenizer, 64 sources sorted by length at a time (its length penalty is length^α, not
                 GNMT's: its outputs differ a little, their BLEU is printed beside)
  CT2 fp32/int8  `ctranslate2.Translator(compute_type=...)` of `ct2-transformers-converter`'s conversion,
                 `translate_batch` of every source at once (max_batch_size 64, which it sorts by length)
Every engine stops at the source length + 50 tokens (the longest source's, at most the model's max_len), uses
--threads intra-op threads (CTranslate2: intra_threads, one translator thread). Each is warmed up on 32
sentences, then --repeats rounds time every engine once over all sources (interleaved, so a busy machine slows
them all alike); medians are quoted. ratio = ours / peer in sentences/s (higher is better; the issue's targets:
>= 2x transformers, >= 0.7x CTranslate2 fp32; int8 is reported beside CTranslate2's int8).

Training: tokens/s of one optimizer step (forward, label-smoothed loss, backward, AdamW update, zero_grad) of ours
and of MarianMTModel (the export, in train mode: the same weights and dropout) on the same batches: --steps
batches of up to --batch-tokens source + target tokens, training pairs of similar length, the loss of both
computed by `label_smoothed_cross_entropy` (ε of the run), both optimizers built by `training.make_optimizer`.
tokens = source + target tokens that are not padding. ratio = ours / peer (target >= 1.3x).

Memory: the extra peak bytes of torch's CPU allocator during one batch of 64 sources (decoding) or one step
(training) beyond the weights (`attention.extra_peak_bytes`); CTranslate2 allocates outside torch: "-".

--quick: 48 sources, 1 round, 2 steps: a check that the script runs (on a tiny run), not a measurement.
Output: a table, then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import copy
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sacrebleu
import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from plainformer.families.transformer import load_translator
from plainformer.hf.marian import marian_order, save_marian
from plainformer.inference.linear_kernels import measure_kernels
from plainformer.inference.quantize import quantize
from plainformer.models.transformer import EXTRA_OUTPUT_TOKENS, Transformer, label_smoothed_cross_entropy
from plainformer.training.config import TrainConfig
from plainformer.training.optim import make_optimizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import extra_peak_bytes

SHARED_DATA = Path(os.environ.get("PLAINFORMER_SHARED_DATA", Path(__file__).resolve().parents[1].parent / "shared"
                                  / "data"))
BEAM, ALPHA, BATCH, WARMUP = 4, 0.6, 64, 32
# (what, ours, peer) rows of the decoding table, by engine name
COMPARISONS = [
    ("beam 4: ours vs transformers", "ours", "transformers"),
    ("beam 4: ours vs CT2 fp32", "ours", "CT2 fp32"),
    ("beam 4: ours int8 vs CT2 int8", "ours int8", "CT2 int8"),
    ("beam 4: ours int8 vs ours fp32", "ours int8", "ours"),
]
Engine = Callable[[list[str]], list[str]]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", type=Path, required=True, help="a translation run (its best/), or a checkpoint")
    parser.add_argument("--data", type=Path, default=SHARED_DATA / "multi30k",
                        help="the Multi30k folder: test_2016_flickr.{de,en}.gz and train.{de,en}.gz")
    parser.add_argument("--source-lang", default="de")
    parser.add_argument("--target-lang", default="en")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads of every engine (default 2)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds")
    parser.add_argument("--steps", type=int, default=10, help="training steps per round")
    parser.add_argument("--batch-tokens", type=int, default=4096, help="source + target tokens per training batch")
    parser.add_argument("--quick", action="store_true", help="a few sentences and steps: does it run?")
    args = parser.parse_args(argv)
    if min(args.threads, args.repeats, args.steps, args.batch_tokens) < 1:
        parser.error("--threads, --repeats, --steps and --batch-tokens must be positive")
    if args.quick:
        args.repeats, args.steps = 1, 2
    return args


def read_lines(path: Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        return [line.rstrip("\n") for line in lines]


# ----------------------------------------------------------------------------- decoding

def _copy(model: Transformer) -> Transformer:
    """A copy of `model` for an engine or the training to change, with the same tokenizer."""
    tokenizer, model.tokenizer = model.tokenizer, None
    try:
        copied = copy.deepcopy(model)
    finally:
        model.tokenizer = tokenizer
    copied.tokenizer = tokenizer
    return copied


def _limit(lengths: list[int], max_len: int) -> int:
    """Output tokens an engine may give a batch: its longest source (</s> included) + 50, at most max_len."""
    return min(max(lengths) + 1 + EXTRA_OUTPUT_TOKENS, max_len)


def engines(model: Transformer, export: Path, ct2: Path | None, threads: int) -> dict[str, Engine]:
    """Name -> function translating a list of sentences."""
    import transformers

    tokenizer = model.tokenizer
    fp32 = measure_kernels(_copy(model))  # as `plainformer translate` decodes
    int8 = quantize(_copy(model), "int8")
    hf = transformers.MarianMTModel.from_pretrained(export).eval()
    hf_tokenizer = transformers.MarianTokenizer.from_pretrained(export)

    def ours(decoder: Transformer) -> Engine:
        return lambda texts: decoder.translate(texts, beam_size=BEAM, length_penalty=ALPHA, batch_size=BATCH)

    def transformers_engine(texts: list[str]) -> list[str]:
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        out = [""] * len(texts)
        for start in range(0, len(order), BATCH):
            chunk = order[start:start + BATCH]
            inputs = hf_tokenizer([texts[i] for i in chunk], return_tensors="pt", padding=True)
            lengths = inputs["attention_mask"].sum(dim=1).tolist()
            with torch.no_grad():
                generated = hf.generate(**inputs, num_beams=BEAM, length_penalty=ALPHA, do_sample=False,
                                        max_new_tokens=_limit([n - 1 for n in lengths], model.config.max_len))
            for i, text in zip(chunk, hf_tokenizer.batch_decode(generated, skip_special_tokens=True), strict=True):
                out[i] = text
        return out

    result = {"ours": ours(fp32), "ours int8": ours(int8), "transformers": transformers_engine}
    if ct2 is not None:
        import ctranslate2

        for kind in ("float32", "int8"):
            translator = ctranslate2.Translator(str(ct2), device="cpu", compute_type=kind, intra_threads=threads,
                                                inter_threads=1)
            result[f"CT2 {'fp32' if kind == 'float32' else kind}"] = _ct2_engine(translator, tokenizer,
                                                                                model.config.max_len)
    return result


def _ct2_engine(translator: Any, tokenizer: Any, max_len: int) -> Engine:
    def translate(texts: list[str]) -> list[str]:
        pieces = [tokenizer.pieces(text) + ["</s>"] for text in texts]  # CT2 appends nothing to Marian's sources
        results = translator.translate_batch(pieces, beam_size=BEAM, length_penalty=ALPHA, max_batch_size=BATCH,
                                             max_decoding_length=_limit([len(p) - 1 for p in pieces], max_len))
        return [tokenizer.decode([tokenizer.token_to_id(piece) for piece in result.hypotheses[0]])
                for result in results]
    return translate


def convert(export: Path, out: Path) -> Path | None:
    """CTranslate2's own converter run on the export, as a user runs it; None where it is not installed."""
    converter = Path(sys.executable).parent / "ct2-transformers-converter"
    if not converter.is_file():
        print(f"CTranslate2 skipped: {converter} is absent (pip install ctranslate2)", file=sys.stderr)
        return None
    subprocess.run([str(converter), "--model", str(export), "--output_dir", str(out)], check=True, capture_output=True)
    return out


def decoding(model: Transformer, export: Path, ct2: Path | None, sources: list[str], references: list[str],
             args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    calls = engines(model, export, ct2, args.threads)
    for call in calls.values():
        call(sources[:WARMUP])
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    outputs: dict[str, list[str]] = {}
    for repeat in range(args.repeats):
        names = list(calls) if repeat % 2 == 0 else list(reversed(calls))
        for name in names:
            start = time.perf_counter()
            outputs[name] = calls[name](sources)
            seconds[name].append(time.perf_counter() - start)
    batch = sorted(sources, key=len)[len(sources) // 2:][:BATCH]  # 64 sources of middle length
    figures = {}
    for name in calls:
        peak = None if name.startswith("CT2") else extra_peak_bytes(lambda call=calls[name]: call(batch))
        figures[name] = {"sentences_per_s": len(sources) / statistics.median(seconds[name]),
                         "seconds": seconds[name], "peak_mib": None if peak is None else peak / 2**20,
                         "bleu": sacrebleu.corpus_bleu(outputs[name], [references]).score,
                         "equal_to_ours": sum(a == b for a, b in zip(outputs[name], outputs["ours"], strict=True))}
    return figures


# ----------------------------------------------------------------------------- training

def training_batches(model: Transformer, pairs: list[tuple[str, str]], batch_tokens: int,
                     count: int) -> list[dict[str, Tensor]]:
    """`count` batches of pairs of similar length, each of at most `batch_tokens` source + target tokens: src
    (</s> ended), tgt_in (<s> first) and tgt_out (</s> last), our ids, right-padded."""
    c, tokenizer = model.config, model.tokenizer
    encoded = [(s + [c.eos_id], t) for s, t in zip(tokenizer.encode_many([p[0] for p in pairs]),
                                                    tokenizer.encode_many([p[1] for p in pairs]), strict=True)
               if s and t and len(s) < c.max_len and len(t) < c.max_len]
    encoded.sort(key=lambda pair: (len(pair[0]), len(pair[1])))
    groups: list[list[tuple[list[int], list[int]]]] = [[]]
    for pair in encoded:
        group = groups[-1]
        longest = max([len(s) + len(t) + 1 for s, t in group + [pair]])
        if group and longest * (len(group) + 1) > batch_tokens:
            groups.append(group := [])
        group.append(pair)
    groups.sort(key=len, reverse=True)  # the fullest batches first
    return [{"src": pad_sequence([torch.tensor(s) for s, _ in group], batch_first=True, padding_value=c.pad_id),
             "tgt_in": pad_sequence([torch.tensor([c.bos_id, *t]) for _, t in group], batch_first=True,
                                    padding_value=c.pad_id),
             "tgt_out": pad_sequence([torch.tensor([*t, c.eos_id]) for _, t in group], batch_first=True,
                                     padding_value=c.pad_id)}
            for group in groups[:count]]


def _as_marian(batch: dict[str, Tensor], model: Transformer, hf: Any) -> dict[str, Tensor]:
    """The batch in the export's ids (pad last): the decoder's first input Marian's start, pad."""
    marian = torch.argsort(marian_order(model.config))
    tgt_in = marian[batch["tgt_in"]]
    tgt_in[:, 0] = hf.config.decoder_start_token_id
    return {"input_ids": marian[batch["src"]], "attention_mask": batch["src"] != model.config.pad_id,
            "decoder_input_ids": tgt_in, "labels": marian[batch["tgt_out"]]}


def training(model: Transformer, export: Path, pairs: list[tuple[str, str]], args: argparse.Namespace
             ) -> dict[str, Any]:
    import transformers

    ours = _copy(model).train()
    hf = transformers.MarianMTModel.from_pretrained(export).train()
    batches = training_batches(model, pairs, args.batch_tokens, args.steps)
    pad, smoothing = model.config.pad_id, model.config.label_smoothing
    tokens = sum(int((b["src"] != pad).sum() + (b["tgt_out"] != pad).sum()) for b in batches)
    hf_batches = [_as_marian(b, model, hf) for b in batches]
    recipe = TrainConfig.from_preset("transformer-paper")

    def ours_step(batch: dict[str, Tensor]) -> Tensor:
        return ours(**batch)[1]

    def hf_step(batch: dict[str, Tensor]) -> Tensor:
        logits = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    decoder_input_ids=batch["decoder_input_ids"]).logits
        return label_smoothed_cross_entropy(logits, batch["labels"], smoothing, hf.config.pad_token_id)

    runs = {"ours": (ours, ours_step, batches), "transformers": (hf, hf_step, hf_batches)}
    optimizers = {name: make_optimizer(module, recipe) for name, (module, _, _) in runs.items()}

    def round_of(name: str) -> float:
        _, step, data = runs[name]
        start = time.perf_counter()
        for batch in data:
            step(batch).backward()
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=True)
        return time.perf_counter() - start

    for name in runs:
        round_of(name)  # warm-up
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for repeat in range(args.repeats):
        for name in (list(runs) if repeat % 2 == 0 else list(reversed(runs))):
            seconds[name].append(round_of(name))

    def one_step(name: str) -> None:
        _, step, data = runs[name]
        step(data[0]).backward()
        optimizers[name].zero_grad(set_to_none=True)

    return {name: {"tokens_per_s": tokens / statistics.median(seconds[name]), "seconds": seconds[name],
                   "peak_mib": extra_peak_bytes(lambda name=name: one_step(name)) / 2**20}
            for name in runs} | {"batches": len(batches), "tokens_per_round": tokens}


# ----------------------------------------------------------------------------- report

def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_translator(args.ckpt)
    if model.tokenizer is None:
        raise SystemExit(f"{args.ckpt} holds no tokenizer: the benchmark translates text")
    src, tgt = args.source_lang, args.target_lang
    sources, references = (read_lines(args.data / f"test_2016_flickr.{lang}.gz") for lang in (src, tgt))
    train = list(zip(*(read_lines(args.data / f"train.{lang}.gz") for lang in (src, tgt)), strict=True))
    if args.quick:
        sources, references, train = sources[:48], references[:48], train[:2000]
    with tempfile.TemporaryDirectory() as tmp:
        export = save_marian(model, Path(tmp) / "marian")
        ct2 = convert(export, Path(tmp) / "ct2")
        decoded = decoding(model, export, ct2, sources, references, args)
        trained = training(model, export, train, args)
    rows = []
    for what, ours, peer in COMPARISONS:
        if ours in decoded and peer in decoded:
            a, b = decoded[ours], decoded[peer]
            peaks = "/".join("-" if x["peak_mib"] is None else f"{x['peak_mib']:.0f}" for x in (a, b))
            rows.append((what, f"{a['sentences_per_s']:.1f}", f"{b['sentences_per_s']:.1f}",
                         f"{a['sentences_per_s'] / b['sentences_per_s']:.2f}x", peaks))
    a, b = trained["ours"], trained["transformers"]
    rows.append(("training tokens/s: ours vs MarianMTModel", f"{a['tokens_per_s']:,.0f}", f"{b['tokens_per_s']:,.0f}",
                 f"{a['tokens_per_s'] / b['tokens_per_s']:.2f}x", f"{a['peak_mib']:.0f}/{b['peak_mib']:.0f}"))
    c = model.config
    print(f"translate benchmark, test2016 {src}->{tgt} ({len(sources)} sentences), {args.threads} thread(s), median "
          f"of {args.repeats} rounds; model {c.encoder_layers}+{c.decoder_layers} layers, d_model {c.d_model}, "
          f"vocabulary {c.tgt_vocab_size}; ratio = ours / peer sentences/s or tokens/s (higher is better)")
    header = ("what", "ours", "peer", "ratio", "peak MiB ours/peer")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(5)]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    print("BLEU (sacreBLEU) and outputs equal to ours: " + ", ".join(
        f"{name} {f['bleu']:.2f} / {f['equal_to_ours']}" for name, f in decoded.items()))
    shape = {k: getattr(c, k) for k in ("n_layers", "d_model", "n_heads", "d_ff", "tgt_vocab_size")}
    print(json.dumps({"benchmark": "translate", "threads": args.threads, "sentences": len(sources), "beam": BEAM,
                      "length_penalty": ALPHA, "quick": args.quick, "decoding": decoded, "training": trained,
                      "model": shape}, sort_keys=True))


if __name__ == "__main__":
    main()
