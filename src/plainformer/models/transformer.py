"""The encoder-decoder Transformer of "Attention Is All You Need" (Vaswani et al. 2017).

    z = Encoder(src)                                   (B, m, d_model), source padding masked
    h = Decoder(tgt_in, z)                             (B, n, d_model), causal over the target
    logits = h Eᵀ (+ b)                                output projection tied to the target embedding E;
                                                       b with output_bias (Marian's final_logits_bias)
    loss = −Σ_k q'(k) log softmax(logits)_k,  q' = (1 − ε_ls)·onehot(y) + ε_ls / V
                                                       label smoothing (section 5.4), padding ignored

Embeddings are scaled by √d_model and summed with sinusoidal positions; with share_embeddings the
source and target share E (one vocabulary, as with the paper's shared BPE). Weights are initialised as
in torch.nn.Transformer (Xavier-uniform matrices) except the embedding, N(0, d_model^−½), so that
E[x]·√d_model has unit variance and the tied logits h Eᵀ start at unit scale.

Decoding (section 6.1) binds the encoder memory of the sources to the decoder (`bind`), which gives the
`generation` module's loops a model of the next target token: greedy decoding is
`generation.generate` at temperature 0, beam search is `generation.beam_search` (beam 4, α = 0.6).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import pad_sequence

from .. import _checks
from ..config import Config, checked, one_of, positive_int, probability
from ..generation.beam_search import beam_search
from ..generation.decoders import SourceBoundDecoder
from ..generation.decoding import generate as generate_tokens
from ..memory import unchecked
from ..nn.attention import BACKENDS
from ..nn.blocks import Decoder, DecoderCache, Encoder
from ..nn.dtypes import at_least_float32
from ..nn.feedforward import ACTIVATIONS
from ..nn.modes import eval_mode
from ..nn.positional import check_even_d_model
from .family_model import FamilyModel

EXTRA_OUTPUT_TOKENS = 50  # translating stops here past the source length (Vaswani et al., section 6.1)

if TYPE_CHECKING:  # annotations only: data/ imports models/, so a runtime import would cycle
    from ..data.tokenizers import Tokenizer


@dataclasses.dataclass
class TransformerConfig(Config):
    """Shape and options of a `Transformer`. The vocabulary sizes and special ids usually come from the
    tokenizer at training time; n_encoder_layers / n_decoder_layers default to n_layers."""

    src_vocab_size: int = positive_int(32000)
    tgt_vocab_size: int = positive_int(32000)
    n_layers: int = positive_int(6)
    n_encoder_layers: int | None = positive_int(None)
    n_decoder_layers: int | None = positive_int(None)
    n_heads: int = positive_int(8)
    n_kv_heads: int | None = positive_int(None)
    d_model: int = checked(512, _checks.check_positive_int, check_even_d_model)  # sinusoidal positions
    d_ff: int = positive_int(2048)
    dropout: float = probability(0.1)
    attention_dropout: float | None = probability(None)  # on the attention weights; None: dropout
    activation_dropout: float | None = probability(None)  # on the feed-forward's hidden layer; None: dropout
    activation: str = one_of("relu", ACTIVATIONS)
    norm_first: bool = False
    share_embeddings: bool = True
    tie_weights: bool = True
    output_bias: bool = False  # logits = h Eᵀ + b (Marian's final_logits_bias, opus-mt's models)
    max_len: int = positive_int(256)
    label_smoothing: float = probability(0.1)
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    source_eos: bool = False  # each source ends with eos_id (fairseq's and Marian's convention)
    backend: str = one_of("auto", BACKENDS)

    HELP: ClassVar[Mapping[str, str]] = {
        "src_vocab_size": "tokens of the source vocabulary (the tokenizer's)",
        "tgt_vocab_size": "tokens of the target vocabulary (the tokenizer's)",
        "n_layers": "layers of the encoder and of the decoder",
        "n_encoder_layers": "layers of the encoder; none: n_layers",
        "n_decoder_layers": "layers of the decoder; none: n_layers",
        "n_heads": "attention heads",
        "n_kv_heads": "key/value heads (grouped-query attention); none: n_heads",
        "d_model": "width of the residual stream, even",
        "d_ff": "hidden width of the feed-forward",
        "dropout": "dropout of embeddings and sublayer outputs",
        "attention_dropout": "dropout of the attention weights; none: dropout",
        "activation_dropout": "dropout of the feed-forward's hidden layer; none: dropout",
        "activation": "the FFN's",
        "norm_first": "pre-LN: x + F(LN(x)); else the paper's post-LN",
        "share_embeddings": "one embedding for source and target tokens",
        "tie_weights": "the output projection is the target embedding",
        "output_bias": "a bias on the output logits (Marian's final_logits_bias)",
        "max_len": "positions: the longest sentence in tokens",
        "label_smoothing": "ε of label smoothing",
        "pad_id": "the padding token (the tokenizer's)",
        "bos_id": "the token that starts a target (the tokenizer's)",
        "eos_id": "the token that ends a sentence (the tokenizer's)",
        "source_eos": "each source ends with eos_id (the tokenizer's)",
        "backend": "the attention kernel",
    }
    PRESETS: ClassVar[Mapping[str, Mapping[str, Any]]] = {
        # Table 3 of the paper: the base model (65M parameters) and the big one (213M).
        "base": dict(n_layers=6, d_model=512, n_heads=8, d_ff=2048, dropout=0.1),
        "big": dict(n_layers=6, d_model=1024, n_heads=16, d_ff=4096, dropout=0.3),
        # CPU presets, chosen by experiment on 2 shared cores (see benchmarks/seq2seq.py). "tiny"
        # learns `copy` exactly in 900 steps; one pre-LN layer without label smoothing converged
        # fastest and most steadily of those tried. "small" learns `numbers-en-fr` in minutes.
        "tiny": dict(n_layers=1, d_model=64, n_heads=4, d_ff=128, dropout=0.0, norm_first=True,
                     label_smoothing=0.0, max_len=64),
        "small": dict(n_layers=2, d_model=128, n_heads=4, d_ff=512, dropout=0.0, max_len=128),
    }

    def validate(self) -> None:
        _checks.check_divisible("d_model", self.d_model, "n_heads", self.n_heads)
        if self.n_kv_heads is not None:
            _checks.check_divisible("n_heads", self.n_heads, "n_kv_heads", self.n_kv_heads)
        if self.share_embeddings and self.src_vocab_size != self.tgt_vocab_size:
            raise ValueError(f"share_embeddings needs one vocabulary, got src_vocab_size="
                             f"{self.src_vocab_size} and tgt_vocab_size={self.tgt_vocab_size}")
        vocab_size = min(self.src_vocab_size, self.tgt_vocab_size)
        for name in ("pad_id", "bos_id", "eos_id"):
            _checks.check_index(name, getattr(self, name), vocab_size, "vocab_size")
        # bos_id may be pad_id: Marian's decoder starts from the pad token (Transformer.forward then masks no
        # target key: the causal mask alone hides the right padding from every real position)
        if self.eos_id in (self.pad_id, self.bos_id):
            raise ValueError(f"eos_id must differ from pad_id and bos_id, got pad_id={self.pad_id}, "
                             f"bos_id={self.bos_id}, eos_id={self.eos_id}")

    @property
    def encoder_layers(self) -> int:
        return self.n_encoder_layers or self.n_layers

    @property
    def decoder_layers(self) -> int:
        return self.n_decoder_layers or self.n_layers


def label_smoothed_cross_entropy(logits: Tensor, targets: Tensor, smoothing: float,
                                 ignore_index: int) -> Tensor:
    """Mean over targets != ignore_index of −Σ_k q'(k) log p(k), q' = (1 − ε)·onehot(y) + ε / V.

    logits (..., V), targets (...). Computed in float32 whatever the logits' dtype.
    """
    return F.cross_entropy(at_least_float32(logits.reshape(-1, logits.shape[-1])), targets.reshape(-1),
                           ignore_index=ignore_index, label_smoothing=smoothing)


def _stack_options(config: TransformerConfig) -> dict[str, Any]:
    """What the encoder and the decoder stack share, as the config says (it checked them: the stacks
    do not check them again)."""
    return dict(d_model=config.d_model, n_heads=config.n_heads, d_ff=config.d_ff, max_len=config.max_len,
                pad_id=config.pad_id, dropout=config.dropout, attention_dropout=config.attention_dropout,
                activation_dropout=config.activation_dropout, activation=config.activation,
                norm_first=config.norm_first, n_kv_heads=config.n_kv_heads, backend=config.backend,
                validate_args=False)


class Transformer(FamilyModel):
    """Encoder-decoder Transformer. forward(src (B, m), tgt_in (B, n), tgt_out (B, n) | None)
    -> (logits (B, n, tgt_vocab_size), label-smoothed loss | None)."""

    family = "transformer"
    config_class = TransformerConfig
    config: TransformerConfig
    tokenizer: Tokenizer | None

    def __init__(self, config: TransformerConfig):
        super().__init__(config)  # checked, and its bytes, before anything is allocated
        self.encoder = Encoder(config.src_vocab_size, n_layers=config.encoder_layers, **_stack_options(config))
        self.decoder = Decoder(config.tgt_vocab_size, n_layers=config.decoder_layers, **_stack_options(config))
        if config.share_embeddings:
            self.decoder.embedding = self.encoder.embedding
        self.output = nn.Linear(config.d_model, config.tgt_vocab_size, bias=config.output_bias)
        self._init_weights()
        if config.tie_weights:
            self.output.weight = self.decoder.embedding.weight

    @classmethod
    def shallow(cls, config: TransformerConfig) -> tuple[TransformerConfig, dict[str, int]]:
        """Each stack one layer deep, counted as many times as it is deep."""
        return (unchecked(config, n_encoder_layers=1, n_decoder_layers=1),
                {"encoder.layers.0": config.encoder_layers, "decoder.layers.0": config.decoder_layers})

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=self.config.d_model ** -0.5)
                with torch.no_grad():
                    module.weight[self.config.pad_id].zero_()

    def num_parameters(self) -> int:
        """Parameters counted once (shared embeddings and the tied projection are one matrix)."""
        return sum(p.numel() for p in self.parameters())

    # ------------------------------------------------------------------ forward

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]:
        """src (B, m) -> (memory (B, m, d_model), source padding mask (B, m), True = real token)."""
        memory = self.encoder(src)  # checks src; its keys are masked where src == pad_id
        return memory, src != self.config.pad_id

    def decode(self, tgt: Tensor, memory: Tensor, memory_key_padding_mask: Tensor | None = None, *,
               tgt_key_padding_mask: Tensor | None = None,
               kv_caches: list[DecoderCache] | None = None) -> Tensor:
        """tgt (B, n) and memory (B, m, d_model) -> next-token logits (B, n, tgt_vocab_size).
        Masks (True = real token) and caches as in `Decoder.forward`."""
        h = self.decoder(tgt, memory, tgt_key_padding_mask=tgt_key_padding_mask,
                         memory_key_padding_mask=memory_key_padding_mask, kv_caches=kv_caches)
        return self.output(h)

    def forward(self, src: Tensor, tgt_in: Tensor, tgt_out: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """src (B, m) source ids, tgt_in (B, n) = BOS y_1 .. y_{n-1}, tgt_out (B, n) = y_1 .. y_n
        (EOS last); pad_id pads all three. Returns logits (B, n, V) and the label-smoothed loss."""
        memory, src_mask = self.encode(src)  # src checked there, tgt_in by the decoder
        _checks.check_tensor("tgt_in", tgt_in, ndim=2, shape_doc="(B, n)")
        if tgt_in.shape[0] != src.shape[0]:
            raise ValueError(f"src and tgt_in must have the same batch size, got src {tuple(src.shape)} "
                             f"and tgt_in {tuple(tgt_in.shape)}")
        # Where the decoder starts from the pad token (bos_id == pad_id), masking pads would hide position 0.
        tgt_mask = None if self.config.bos_id == self.config.pad_id else tgt_in != self.config.pad_id
        logits = self.decode(tgt_in, memory, src_mask, tgt_key_padding_mask=tgt_mask)
        if tgt_out is None:
            return logits, None
        _checks.check_same_shape("tgt_out", tgt_out, "tgt_in", tgt_in)
        loss = label_smoothed_cross_entropy(logits, tgt_out, self.config.label_smoothing, self.config.pad_id)
        return logits, loss

    # ------------------------------------------------------------------ decoding

    def bind(self, src: Tensor, *, max_len: int | None = None) -> SourceBoundDecoder:
        """Encode src (B, m) once; the result predicts target tokens for `generation`'s loops.
        max_len: target positions it holds (its block_size and cache length; default config.max_len)."""
        memory, mask = self.encode(src)
        return SourceBoundDecoder(self, memory, mask, max_len or self.config.max_len)

    @torch.no_grad()
    def generate(self, src: Tensor, *, beam_size: int = 1, length_penalty: float = 0.6,
                 max_new_tokens: int | None = None, use_cache: bool = True) -> Tensor:
        """Translate src (B, m) -> (B, 1 + L): BOS, the output tokens, then EOS padding.

        beam_size 1 is greedy decoding; otherwise beam search with length penalty α = length_penalty.
        By default row b stops after (its source length + 50) tokens (at most max_len).
        The source ids are checked once here; the decoding steps check nothing that needs a sync.
        """
        _checks.check_positive_int("beam_size", beam_size)
        _checks.check_non_negative_number("length_penalty", length_penalty)  # greedy too: one rule
        _checks.check_token_ids("src", src, self.config.src_vocab_size)
        with eval_mode(self):
            limits = (src != self.config.pad_id).sum(dim=1) + EXTRA_OUTPUT_TOKENS  # (B,)
            steps = min(int(limits.max()), self.config.max_len) if max_new_tokens is None else max_new_tokens
            # The last token is predicted from `steps` positions: caches that long, no longer.
            bound = self.bind(src, max_len=min(max(1, steps), self.config.max_len))
            bos = torch.full((src.shape[0], 1), self.config.bos_id, dtype=torch.long, device=src.device)
            if beam_size == 1:
                tokens = generate_tokens(bound, bos, steps, temperature=0.0, eos_id=self.config.eos_id,
                                         use_cache=use_cache)
            else:
                tokens, _ = beam_search(bound, bos, steps, beam_size=beam_size, length_penalty=length_penalty,
                                        eos_id=self.config.eos_id, use_cache=use_cache)
        if max_new_tokens is None:
            position = torch.arange(tokens.shape[1], device=tokens.device)  # BOS is position 0
            tokens = tokens.masked_fill(position > limits.unsqueeze(1), self.config.eos_id)
        return tokens

    def translate(self, texts: Sequence[str], *, beam_size: int = 1, length_penalty: float = 0.6,
                  batch_size: int = 64, tokenizer: Any = None,
                  progress: Callable[[int], object] | None = None) -> list[str]:
        """Translate sentences with `tokenizer` (default: the checkpoint's), batching sources of
        similar length together; the translations come back in the order of `texts`. `progress` is told
        the sentences of each batch once translated."""
        tokenizer = tokenizer or self.tokenizer
        if tokenizer is None:
            raise ValueError("translate needs a tokenizer: pass tokenizer=... or load the model with "
                             "Transformer.from_checkpoint")
        if isinstance(texts, str):
            raise TypeError("texts must be a list of str, got a str; wrap one sentence in a list")
        _checks.check_positive_int("batch_size", batch_size)
        eos = [self.config.eos_id] if self.config.source_eos else []
        encoded = [torch.tensor([*ids, *eos] if ids else [], dtype=torch.long) for ids in tokenizer.encode_many(texts)]
        order = sorted((i for i in range(len(encoded)) if len(encoded[i])), key=lambda i: len(encoded[i]))
        device = self.encoder.embedding.weight.device  # the output layer may hold int8 weights (quantize)
        translations = [""] * len(encoded)  # an empty source translates to an empty target
        for start in range(0, len(order), batch_size):
            chunk = order[start:start + batch_size]
            src = pad_sequence([encoded[i] for i in chunk], batch_first=True, padding_value=self.config.pad_id)
            for i, row in zip(chunk, self.generate(src.to(device), beam_size=beam_size,
                                                   length_penalty=length_penalty), strict=True):
                translations[i] = tokenizer.decode(row[1:])
            if progress is not None:
                progress(len(chunk))
        return translations
