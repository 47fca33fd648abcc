"""Test support for the encoder-decoder: torch.nn reference modules with weights copied from ours.

torch's decoder layer calls its cross-attention `multihead_attn` and its feed-forward `linear1`,
`linear2`; ours `cross_attn` and `ff.W_1`, `ff.W_2`. torch.nn.Transformer has no embeddings,
positions or output projection, so `TorchSeq2Seq` wraps it in copies of ours.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import Tensor, nn

from plainformer.models.transformer import Transformer
from plainformer.nn.blocks import DecoderLayer
from tests.reference.torch_reference import (
    attention_parameter_grads,
    load_torch_attention,
    load_torch_encoder_layer,
)


def load_torch_decoder_layer(ours: DecoderLayer, theirs: nn.TransformerDecoderLayer) -> None:
    load_torch_attention(ours.self_attn, theirs.self_attn)
    load_torch_attention(ours.cross_attn, theirs.multihead_attn)
    with torch.no_grad():
        for mine, their in ((ours.ff.W_1, theirs.linear1), (ours.ff.W_2, theirs.linear2),
                            (ours.norm1, theirs.norm1), (ours.norm2, theirs.norm2),
                            (ours.norm3, theirs.norm3)):
            mine.weight.copy_(their.weight)
            mine.bias.copy_(their.bias)


def randomize_norms(module: nn.Module, generator: torch.Generator) -> None:
    """Random γ, β in every LayerNorm and random biases (torch initialises them to 1 and 0)."""
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            if "bias" in name or "norm" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator))


def torch_transformer(model: Transformer) -> nn.Transformer:
    """nn.Transformer (batch_first) of the model's shape holding its layer weights.

    nn.Transformer always ends each stack with a LayerNorm; the paper's post-LN stacks have none, so
    for post-LN the stacks are built without one (pre-LN ones copy our final norms).
    """
    c = model.config
    layer_options = dict(d_model=c.d_model, nhead=c.n_heads, dim_feedforward=c.d_ff, dropout=c.dropout,
                         batch_first=True, norm_first=c.norm_first)
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(**layer_options), c.encoder_layers,
                                    norm=nn.LayerNorm(c.d_model) if c.norm_first else None,
                                    enable_nested_tensor=False)
    decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(**layer_options), c.decoder_layers,
                                    norm=nn.LayerNorm(c.d_model) if c.norm_first else None)
    theirs = nn.Transformer(d_model=c.d_model, nhead=c.n_heads, dropout=c.dropout, batch_first=True,
                            custom_encoder=encoder, custom_decoder=decoder)
    for mine, their in zip(model.encoder.layers, encoder.layers, strict=True):
        load_torch_encoder_layer(mine, their)
    for mine, their in zip(model.decoder.layers, decoder.layers, strict=True):
        load_torch_decoder_layer(mine, their)
    if c.norm_first:
        with torch.no_grad():
            for mine, their in ((model.encoder.norm, encoder.norm), (model.decoder.norm, decoder.norm)):
                their.weight.copy_(mine.weight)
                their.bias.copy_(mine.bias)
    return theirs


class TorchSeq2Seq(nn.Module):
    """torch's nn.Transformer between a copy of the model's shared embedding E (scaled by √d_model,
    plus the sinusoidal table) and the tied output projection E hᵀ. Needs share_embeddings."""

    def __init__(self, model: Transformer):
        super().__init__()
        assert model.config.share_embeddings and model.config.tie_weights
        self.config = model.config
        self.embedding = copy.deepcopy(model.encoder.embedding)
        self.register_buffer("pe", model.encoder.positional.pe.clone())
        self.body = torch_transformer(model)

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        pad, scale = self.config.pad_id, math.sqrt(self.config.d_model)
        x = self.embedding(src) * scale + self.pe[:src.shape[1]]
        y = self.embedding(tgt_in) * scale + self.pe[:tgt_in.shape[1]]
        n = tgt_in.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool).triu(1)  # True = may not attend
        h = self.body(x, y, tgt_mask=causal, tgt_is_causal=True, src_key_padding_mask=src == pad,
                      tgt_key_padding_mask=tgt_in == pad, memory_key_padding_mask=src == pad)
        return h @ self.embedding.weight.T


def layer_grads(layer: nn.Module) -> list[Tensor]:
    """Gradients of all parameters of an encoder or decoder layer, ours or torch's, in one order:
    attention projections (self, then cross), the two feed-forward linears, the norms."""
    if isinstance(layer, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
        decoder = isinstance(layer, nn.TransformerDecoderLayer)
        attentions = [layer.self_attn, *([layer.multihead_attn] if decoder else [])]
        linears = [layer.linear1, layer.linear2]
    else:
        decoder = isinstance(layer, DecoderLayer)
        attentions = [layer.self_attn, *([layer.cross_attn] if decoder else [])]
        linears = [layer.ff.W_1, layer.ff.W_2]
    norms = [layer.norm1, layer.norm2, *([layer.norm3] if decoder else [])]
    grads = [g for attention in attentions for g in attention_parameter_grads(attention)]
    return grads + [p.grad for module in linears + norms for p in (module.weight, module.bias)]
