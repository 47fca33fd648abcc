"""Device-to-host syncs on the hot paths, counted with torch.profiler.

A sync is an `aten::_local_scalar_dense`: what `.item()`, `int(tensor)` and `bool(tensor)` run (the
first two record an `aten::item` around it, which is the same sync, counted once here). On a GPU each
one stalls the host until the device catches up, and under torch.compile each is a graph break, so a
training forward must have none, and decoding at most one per new token (the end-of-sequence test of
`generate`'s loop). Counted on CPU: the ops are the same on every device.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import plainformer as pf
from tests.reference.tiny_models import GPT_VARIANTS_49

SYNC_OP = "aten::_local_scalar_dense"
TINY_GPT = dict(vocab_size=40, block_size=32, n_layers=2, n_heads=2, d_model=16, d_ff=32)


def count_syncs(run: Callable[[], object]) -> int:
    """The number of host syncs `run` performs."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    return sum(1 for event in prof.events() if event.name == SYNC_OP)


def _ids(vocab: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(0))


def test_a_counted_sync_is_seen():
    """The counter itself: .item() and bool() of a tensor are syncs."""
    x = torch.ones(3)
    assert count_syncs(lambda: (x.sum().item(), bool(x.all()), int(x.max()))) == 3


@pytest.mark.parametrize("pos_encoding", ["learned", "rope", "sinusoidal"])
@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_a_gpt_training_forward_and_backward_perform_no_sync(pos_encoding, backend):
    torch.manual_seed(0)
    model = pf.GPT(pf.GPTConfig(**TINY_GPT, pos_encoding=pos_encoding, backend=backend, dropout=0.1)).train()
    idx, targets = _ids(40, 2, 16), _ids(40, 2, 16)
    targets[0, :3] = -100

    def step() -> None:
        _, loss = model(idx, targets)
        loss.backward()

    assert count_syncs(step) == 0


def test_a_gpt_with_every_issue_49_variant_trains_and_decodes_padded_prompts_without_a_sync_of_its_own():
    torch.manual_seed(0)
    model = pf.GPT(pf.GPTConfig(**TINY_GPT, **GPT_VARIANTS_49, pos_encoding="rope")).train()
    idx, targets = _ids(40, 2, 16), _ids(40, 2, 16)

    def step() -> None:
        _, loss = model(idx, targets)
        loss.backward()

    assert count_syncs(step) == 0
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9]]
    generators = [torch.Generator().manual_seed(seed) for seed in range(3)]
    assert count_syncs(lambda: model.generate(prompts, 20, temperature=1.0, generator=generators)) <= 20 + 2


@pytest.mark.parametrize("variants", [
    dict(pos_encoding="alibi", qk_norm=True, attn_softcap=30.0, sliding_window=6, backend="math"),
    dict(pos_encoding="alibi", qk_norm=True, sliding_window=6, backend="sdpa"),
    dict(pos_encoding="rope", qk_norm=True, attn_softcap=30.0, sliding_window=6, backend="flash"),
], ids=["math", "sdpa", "flash"])
def test_the_attention_variants_train_with_no_sync_and_decode_with_one_per_token(variants):
    torch.manual_seed(0)
    model = pf.GPT(pf.GPTConfig(**TINY_GPT, **variants)).train()
    idx, targets = _ids(40, 2, 16), _ids(40, 2, 16)

    def step() -> None:
        _, loss = model(idx, targets)
        loss.backward()

    assert count_syncs(step) == 0
    generator = torch.Generator().manual_seed(1)
    assert count_syncs(lambda: model.generate(idx[:, :5], 20, temperature=1.0, generator=generator)) <= 20 + 1


@pytest.mark.parametrize("use_cache", [True, False])
def test_gpt_generate_performs_at_most_one_sync_per_new_token(use_cache):
    """20 new tokens: at most one sync per step, plus the check of the prompt's ids (one sync)."""
    torch.manual_seed(0)
    model = pf.GPT(pf.GPTConfig(**TINY_GPT))
    prompt = _ids(40, 2, 5)
    syncs = count_syncs(lambda: model.generate(prompt, 20, temperature=1.0, top_k=10, use_cache=use_cache,
                                               generator=torch.Generator().manual_seed(1)))
    assert syncs <= 20 + 1


def test_prompts_of_different_lengths_sync_once_per_new_token_at_most():
    """20 new tokens for 3 left-padded prompts, sampled with a generator each: the prompts' check, then
    at most one sync per step (none without eos), then one read of every row's tokens."""
    torch.manual_seed(0)
    model = pf.GPT(pf.GPTConfig(**TINY_GPT))
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9]]
    generators = [torch.Generator().manual_seed(seed) for seed in range(3)]
    syncs = count_syncs(lambda: model.generate(prompts, 20, temperature=1.0, top_k=10, generator=generators))
    assert syncs <= 20 + 2


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_iter_generate_with_eos_syncs_once_per_token(temperature):
    """With eos_id the loop asks once per token whether every row has finished; when sampling, the
    same host read says whether a row had no distribution to sample from."""
    torch.manual_seed(0)
    model = pf.GPT(pf.GPTConfig(**TINY_GPT)).eval()
    with torch.no_grad():
        syncs = count_syncs(lambda: list(pf.iter_generate(model.decoder(), _ids(40, 2, 3), 20,
                                                          temperature=temperature, eos_id=39,
                                                          generator=torch.Generator().manual_seed(1))))
    assert syncs <= 20


def test_a_bert_forward_and_backward_perform_no_sync():
    torch.manual_seed(0)
    config = pf.BertConfig(vocab_size=50, max_len=16, n_layers=2, n_heads=2, d_model=16, d_ff=32)
    model = pf.BertForSequenceClassification(config).train()
    ids = _ids(50, 3, 12)
    ids[1, 8:] = config.pad_id  # padded keys: the key-padding mask is derived from pad_id
    types = torch.zeros_like(ids)

    def step() -> None:
        _, loss = model(ids, token_type_ids=types, labels=torch.tensor([0, 1, 1]))
        loss.backward()

    assert count_syncs(step) == 0


def test_a_transformer_training_forward_and_backward_perform_no_sync():
    torch.manual_seed(0)
    config = pf.TransformerConfig(src_vocab_size=30, tgt_vocab_size=30, n_layers=2, n_heads=2, d_model=16,
                                  d_ff=32, max_len=16)
    model = pf.Transformer(config).train()
    src, tgt_in, tgt_out = _ids(30, 2, 9), _ids(30, 2, 7), _ids(30, 2, 7)
    src[1, 6:] = tgt_in[1, 5:] = tgt_out[1, 5:] = config.pad_id

    def step() -> None:
        _, loss = model(src, tgt_in, tgt_out)
        loss.backward()

    assert count_syncs(step) == 0


def test_translating_performs_at_most_one_sync_per_new_token():
    """Greedy decoding with eos: one sync per step (have all rows finished?), plus a fixed few per
    call (the source ids' range, the longest source)."""
    torch.manual_seed(0)
    config = pf.TransformerConfig(src_vocab_size=30, tgt_vocab_size=30, n_layers=1, n_heads=2, d_model=16,
                                  d_ff=32, max_len=32)
    model = pf.Transformer(config)
    src = _ids(30, 2, 6).clamp_min(3)  # real tokens only, no padding or special ids
    syncs = count_syncs(lambda: model.generate(src, max_new_tokens=20))
    assert syncs <= 20 + 2
