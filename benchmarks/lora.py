"""LoRA training steps against full fine-tuning, and against Hugging Face PEFT (issue 25).

    python benchmarks/lora.py [--batch 8] [--seq 256] [--r 8] [--repeats 5] [--threads 2]

1. At the 6x384 GPT shape (`train_gpt.py`'s), one training step = forward, backward, AdamW step, of
   - full fine-tuning: every weight trains;
   - LoRA r on W_q and W_v (`pf.add_lora`): the base frozen, only A and B train.
   Reported: tokens/s (ratio = LoRA / full, higher is better; target >= 1.2x), the extra peak memory of a
   step (torch's CPU allocator, `attention.extra_peak_bytes`), and the optimizer state's bytes (AdamW's
   exp_avg and exp_avg_sq; target: LoRA's <= 2% of full's).
2. A Llama-shaped model of the same size: our GPT with LoRA against transformers' LlamaForCausalLM with
   `peft.get_peft_model` (the same r, alpha and targets, sdpa attention), same weights, same tokens;
   ratio = ours / PEFT tokens/s (higher is better; target >= 1.2x).
Each step is warmed up, then `--repeats` rounds time every contender once (interleaved); medians quoted.
Output: a table, then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import peft
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plainformer as pf
from attention import extra_peak_bytes, median_times
from plainformer.hf.gpt import state_to_hf

SHAPE = dict(n_layers=6, n_heads=6, d_model=384, d_ff=1536, vocab_size=65)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--r", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if min(args.batch, args.seq, args.r, args.repeats) < 1:
        parser.error("--batch, --seq, --r and --repeats must be positive")
    return args


def _trainer(forward: Callable[[torch.Tensor], torch.Tensor], parameters: list[torch.nn.Parameter],
             idx: torch.Tensor) -> tuple[Callable[[], None], torch.optim.Optimizer]:
    """One training step (forward -> loss, backward, AdamW step) of the given trainable parameters."""
    optimizer = torch.optim.AdamW(parameters, lr=1e-4)

    def step() -> None:
        forward(idx).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, optimizer


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)


def _gpt(pos_encoding: str, args: argparse.Namespace) -> pf.GPT:
    torch.manual_seed(0)
    changes = dict(norm="rmsnorm", activation="swiglu", d_ff=1024) if pos_encoding == "rope" else {}
    return pf.GPT(pf.GPTConfig(**{**SHAPE, **changes}, block_size=args.seq, pos_encoding=pos_encoding))


def lora_vs_full(args: argparse.Namespace, idx: torch.Tensor) -> dict:
    full, lora = _gpt("learned", args), pf.add_lora(_gpt("learned", args), r=args.r, alpha=2.0 * args.r)
    steps, optimizers = {}, {}
    for name, model, trained in (("full", full, list(full.parameters())),
                                 ("lora", lora, pf.lora_parameters(lora))):
        steps[name], optimizers[name] = _trainer(lambda x, m=model: m(x[:, :-1], x[:, 1:])[1], trained, idx)
    times = median_times(steps, args.repeats)
    tokens = idx[:, :-1].numel()
    row = {name: {"tokens_per_s": tokens / times[name], "peak_mib": extra_peak_bytes(steps[name]) / 2**20,
                  "optimizer_state_mib": _state_bytes(optimizers[name]) / 2**20} for name in steps}
    row["ratio"] = row["lora"]["tokens_per_s"] / row["full"]["tokens_per_s"]
    row["state_fraction"] = row["lora"]["optimizer_state_mib"] / row["full"]["optimizer_state_mib"]
    return row


def ours_vs_peft(args: argparse.Namespace, idx: torch.Tensor) -> dict:
    ours = _gpt("rope", args)
    c = ours.config
    config = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.d_model, intermediate_size=c.d_ff, num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads, max_position_embeddings=c.block_size, rms_norm_eps=c.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_base}, tie_word_embeddings=c.tie_weights,
        attn_implementation="sdpa", bos_token_id=None, eos_token_id=None)
    theirs = transformers.LlamaForCausalLM(config)
    theirs.load_state_dict(state_to_hf(ours.state_dict(), c), strict=False)
    theirs = peft.get_peft_model(theirs, peft.LoraConfig(r=args.r, lora_alpha=2 * args.r,
                                                         target_modules=["q_proj", "v_proj"]))
    pf.add_lora(ours, r=args.r, alpha=2.0 * args.r)
    with torch.no_grad():  # the same function before training: B = 0 in both
        first_loss = {"ours": ours(idx[:, :-1], idx[:, 1:])[1].item(),
                      "peft": theirs(input_ids=idx[:, :-1], labels=idx[:, :-1]).loss.item()}
    steps = {
        "ours": _trainer(lambda x: ours(x[:, :-1], x[:, 1:])[1], pf.lora_parameters(ours), idx)[0],
        "peft": _trainer(lambda x: theirs(input_ids=x[:, :-1], labels=x[:, :-1]).loss,
                         [p for p in theirs.parameters() if p.requires_grad], idx)[0],
    }
    times = median_times(steps, args.repeats)
    tokens = idx[:, :-1].numel()
    row = {name: {"tokens_per_s": tokens / times[name], "peak_mib": extra_peak_bytes(steps[name]) / 2**20}
           for name in steps}
    row["ratio"] = row["ours"]["tokens_per_s"] / row["peft"]["tokens_per_s"]
    row["first_loss"] = first_loss
    return row


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    idx = torch.randint(0, SHAPE["vocab_size"], (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}, "
          f"{torch.get_num_threads()} threads; 6x384, batch {args.batch}x{args.seq}, LoRA r={args.r} on W_q, W_v")
    full = lora_vs_full(args, idx)
    against = ours_vs_peft(args, idx)
    print(f"{'what':34s} {'tok/s':>9s} {'peer tok/s':>10s} {'ratio':>6s}  {'peak MiB':>15s}  optimizer state MiB")
    print("-" * 100)
    print(f"{'LoRA vs full fine-tuning (GPT-2)':34s} {full['lora']['tokens_per_s']:9,.0f} "
          f"{full['full']['tokens_per_s']:10,.0f} {full['ratio']:5.2f}x  "
          f"{full['lora']['peak_mib']:6.0f}/{full['full']['peak_mib']:<8.0f}  "
          f"{full['lora']['optimizer_state_mib']:.2f}/{full['full']['optimizer_state_mib']:.1f} "
          f"({100 * full['state_fraction']:.2f}%)")
    print(f"{'ours vs PEFT, LoRA (Llama shape)':34s} {against['ours']['tokens_per_s']:9,.0f} "
          f"{against['peft']['tokens_per_s']:10,.0f} {against['ratio']:5.2f}x  "
          f"{against['ours']['peak_mib']:6.0f}/{against['peft']['peak_mib']:<8.0f}  first loss "
          f"{against['first_loss']['ours']:.4f}/{against['first_loss']['peft']:.4f}")
    print("ratio = ours (first) / peer tokens/s, higher is better; peak = extra MiB of one step, ours/peer")
    print(json.dumps({"benchmark": "lora", "threads": torch.get_num_threads(), "batch": args.batch,
                      "seq": args.seq, "r": args.r, "lora_vs_full": full, "ours_vs_peft": against}))


if __name__ == "__main__":
    main()
