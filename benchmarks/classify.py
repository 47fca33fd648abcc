"""Fine-tuning and classifying with MiniLM on SST-2: ours against transformers' Trainer and pipeline (issue 55).

    python benchmarks/classify.py [--steps 60] [--warmup 10] [--batch-size 32] [--threads 2] [--repeats 3]
    python benchmarks/classify.py --quick        a tiny random BERT, a few steps and sentences: the script runs

Fine-tuning: one model (MiniLM with one new classifier head, written once and loaded by both), the same
batches (our source's of SST-2's train.tsv, grouped by length, handed to both in the same order), AdamW with
the same settings, float32, `--threads` threads. Ours is plainformer's Trainer as `plainformer finetune` runs
it (on the linear kernels it measures for the run); the peer is transformers' Trainer, fed one of those
batches per step. Throughput is input tokens (padding included) per second of the steps after the first
`--warmup`, each step timed from when it asks for its batch to when the next one does; ratio = ours / peer.

Classifying: the sentences of GLUE's SST-2 dev set (glue_dev.tsv), from text to class probabilities: ours
with `families.classifier.class_probabilities` (batches of `--classify-batch-size` sentences of like length),
the peer `transformers.pipeline("text-classification")` as a user calls it (one sentence at a time), and with
its batch_size set to ours. Each is warmed up, then the `--repeats` rounds run every variant once per round
(interleaved), medians quoted; ratio = ours / peer in sentences per second (higher is better); memory: the
extra peak bytes of torch's CPU allocator during one pass (benchmarks/attention.py's count).

Output: a table, then one JSON line with every figure. The data: ../shared/data/sst2 ($PLAINFORMER_SHARED_DATA).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import extra_peak_bytes, median_times
from plainformer.data.classification import ClassificationBatchSource
from plainformer.data.labelled import read_classification_data, read_labelled
from plainformer.families.classifier import class_probabilities, classifier_from_base
from plainformer.hf.auto import save_hf
from plainformer.hf.bert import minilm_path
from plainformer.training.config import TrainConfig
from plainformer.training.kernels import chosen_kernels, run_kernels
from plainformer.training.trainer import Trainer

SHARED_DATA = Path(os.environ.get("PLAINFORMER_SHARED_DATA",
                                  Path(__file__).resolve().parents[1].parent / "shared" / "data"))
LR, WEIGHT_DECAY, BETA2, GRAD_CLIP, SEQ_LEN = 1e-4, 0.01, 0.999, 1.0, 128


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="training steps of each trainer")
    parser.add_argument("--warmup", type=int, default=10, help="first steps left out of the throughput")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--classify-batch-size", type=int, default=64)
    parser.add_argument("--sentences", type=int, default=None, help="of glue_dev.tsv (default: all 872)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--data", type=Path, default=SHARED_DATA / "sst2")
    parser.add_argument("--quick", action="store_true", help="a tiny random BERT, 6 steps, 32 sentences, 1 round")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.sentences, args.repeats = 6, 2, 32, 1
    if args.steps - args.warmup < 2 or min(args.warmup, args.batch_size, args.classify_batch_size, args.repeats) < 1:
        parser.error("--steps must exceed --warmup by 2 or more; --warmup, the batch sizes and --repeats must be "
                     "positive")
    if not (args.data / "train.tsv").is_file():
        parser.error(f"{args.data} holds no SST-2 (train.tsv, val.tsv, glue_dev.tsv): see ../shared/data/README.md")
    return args


def tiny_base(directory: Path) -> Path:
    """A random BERT of 1 layer, 16 wide, with MiniLM's tokenizer: --quick's model."""
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=30522, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=SEQ_LEN)
    transformers.BertModel(config).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(minilm_path() / name, directory / name)
    return directory


class StepClock:
    """Each step's start (when it asks for its batch) and its input tokens."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.tokens: list[int] = []

    def tick(self, batch: dict[str, torch.Tensor]) -> None:
        self.starts.append(time.perf_counter())
        self.tokens.append(batch["input_ids"].numel())

    def tokens_per_s(self, warmup: int) -> float:
        """Tokens of steps warmup .. n-2 over the time from step warmup's start to step n-1's."""
        return sum(self.tokens[warmup:-1]) / (self.starts[-1] - self.starts[warmup])


class ClockedSource:
    """Our source's training batches, each step's clocked."""

    def __init__(self, source: ClassificationBatchSource, clock: StepClock):
        self.source, self.clock = source, clock

    def get_batch(self, split: str, index: int, batch_size: int) -> dict[str, torch.Tensor]:
        batch = self.source.get_batch(split, index, batch_size)
        if split == "train":
            self.clock.tick(batch)
        return batch


def train_ours(directory: Path, source: ClassificationBatchSource, args: argparse.Namespace, out: Path) -> float:
    from plainformer.families import load_model

    model = load_model(directory).train()
    config = TrainConfig(max_steps=args.steps, batch_size=args.batch_size, lr=LR, min_lr=0.0, schedule="linear",
                         warmup_steps=args.warmup, weight_decay=WEIGHT_DECAY, beta2=BETA2, grad_clip=GRAD_CLIP,
                         eval_interval=0, save_interval=0, eval_batches=1, log_interval=args.steps, dtype="float32")
    clock = StepClock()
    clocked = ClockedSource(source, clock)
    kernels, note = run_kernels(model, config, clocked, out)
    print(note or "linear kernels: aten", file=sys.stderr)
    with chosen_kernels(model, kernels):
        Trainer(model, clocked, config, out, progress=False).fit()
    return clock.tokens_per_s(args.warmup)


def train_peer(directory: Path, batches: list[dict[str, torch.Tensor]], args: argparse.Namespace, out: Path) -> float:
    import transformers

    clock = StepClock()

    class Batches(torch.utils.data.IterableDataset):
        def __iter__(self):
            for batch in batches:
                clock.tick(batch)
                yield {**batch, "attention_mask": batch["attention_mask"].long()}

    model = transformers.BertForSequenceClassification.from_pretrained(directory)
    training = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=1, max_steps=args.steps, learning_rate=LR,
        lr_scheduler_type="linear", warmup_steps=args.warmup, weight_decay=WEIGHT_DECAY, adam_beta2=BETA2,
        max_grad_norm=GRAD_CLIP, logging_strategy="no", save_strategy="no", report_to=[], use_cpu=True,
        dataloader_num_workers=0, disable_tqdm=True, remove_unused_columns=False, seed=0)
    trainer = transformers.Trainer(model=model, args=training, train_dataset=Batches(),
                                   data_collator=lambda features: features[0])
    trainer.remove_callback(transformers.PrinterCallback)  # stdout holds the table
    trainer.train()
    return clock.tokens_per_s(args.warmup)


def classify_rows(directory: Path, sentences: list[str], args: argparse.Namespace) -> tuple[list[dict], float]:
    import transformers

    from plainformer.families import load_model

    ours = load_model(directory)
    pipeline = transformers.pipeline("text-classification", model=str(directory), top_k=None, device="cpu")
    b = args.classify_batch_size
    calls = {"classify: plainformer": lambda: class_probabilities(ours, sentences, batch_size=b, max_len=SEQ_LEN),
             "classify: pipeline": lambda: pipeline(sentences),
             f"classify: pipeline batch {b}": lambda: pipeline(sentences, batch_size=b)}
    warm = sentences[:16]
    class_probabilities(ours, warm, batch_size=b)
    pipeline(warm)
    pipeline(warm, batch_size=b)
    theirs = torch.tensor([[entry["score"] for entry in sorted(row, key=lambda e: ours.config.class_names().index(
        e["label"]))] for row in pipeline(sentences, batch_size=b)])
    difference = float((class_probabilities(ours, sentences, batch_size=b, max_len=SEQ_LEN) - theirs).abs().max())
    seconds = median_times(calls, args.repeats)
    peer = len(sentences) / seconds["classify: pipeline"]
    rows = []
    for name, call in calls.items():
        rate = len(sentences) / seconds[name]
        rows.append({"what": name, "per_s": rate, "peer_per_s": peer, "ratio": rate / peer, "unit": "sentences/s",
                     "peak_mib": extra_peak_bytes(lambda call=call: call()) / 2**20})
    return rows, difference


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="plainformer-classify-bench-"))
    try:
        base = tiny_base(work / "tiny") if args.quick else minilm_path()
        data = read_classification_data(args.data / "train.tsv", args.data / "glue_dev.tsv")
        torch.manual_seed(0)
        model = classifier_from_base(base, {"n_labels": len(data.classes), "label_names": data.classes})
        save_hf(model, work / "start")  # one start for both trainers and both classifiers
        source = ClassificationBatchSource(data, model.tokenizer, SEQ_LEN, seed=0)
        batches = [source.get_batch("train", i, args.batch_size) for i in range(args.steps)]
        ours = train_ours(work / "start", source, args, work / "ours")
        peer = train_peer(work / "start", batches, args, work / "peer")
        sentences = read_labelled(args.data / "glue_dev.tsv").texts[:args.sentences]
        rows = [{"what": "fine-tune: plainformer Trainer", "per_s": ours, "peer_per_s": peer, "ratio": ours / peer,
                 "unit": "tokens/s", "peak_mib": None}]
        classified, difference = classify_rows(work / "start", sentences, args)
        rows += classified
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"# {'a tiny random BERT' if args.quick else 'all-MiniLM-L6-v2'}, {torch.get_num_threads()} threads; "
          f"fine-tuning: {args.steps} steps of {args.batch_size} SST-2 rows, the first {args.warmup} untimed; "
          f"classifying: {len(sentences)} glue_dev sentences, median of {args.repeats}; ratio = ours / peer "
          f"(higher is better)", file=sys.stderr)
    print(f"{'what':<32} {'ours/s':>10} {'peer/s':>10} {'ratio':>6} {'unit':>12} {'peak MiB':>9}")
    for row in rows:
        peak = "" if row["peak_mib"] is None else f"{row['peak_mib']:.1f}"
        print(f"{row['what']:<32} {row['per_s']:>10.1f} {row['peer_per_s']:>10.1f} {row['ratio']:>6.2f} "
              f"{row['unit']:>12} {peak:>9}")
    print(f"max |ours - pipeline| probability = {difference:.2e}", file=sys.stderr)
    print(json.dumps({"benchmark": "classify", "model": "tiny" if args.quick else "all-MiniLM-L6-v2",
                      "threads": torch.get_num_threads(), "steps": args.steps, "warmup": args.warmup,
                      "batch_size": args.batch_size, "sentences": len(sentences), "repeats": args.repeats,
                      "max_abs_probability_difference": difference, "results": rows}))


if __name__ == "__main__":
    main()
