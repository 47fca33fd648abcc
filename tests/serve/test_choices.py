"""A choice's text as a stream sends it: what could begin a stop string, or a character cut in two by
byte-level tokens, waits for the next token; the deltas concatenate to the final text."""

from __future__ import annotations

from plainformer.data.tokenizers import BPETokenizer
from plainformer.generation.stopping import StopStrings
from plainformer.serve.choices import Choice


def stream(tokenizer, ids: list[int], stop: StopStrings | None) -> tuple[list[str], str]:
    choice = Choice(0, prompt=[0])
    deltas = []
    for i, token in enumerate(ids):
        choice.tokens.append(token)
        if i == len(ids) - 1:
            choice.finish = "length"
        deltas.append(choice.delta(tokenizer, stop))
    return deltas, choice.text(tokenizer, stop)


def test_deltas_hold_back_half_characters_and_stop_prefixes():
    tokenizer = BPETokenizer.train("plain text only", vocab_size=260)
    ids = tokenizer.encode("café au lait")
    prefixes = [tokenizer.decode(ids[:i + 1]) for i in range(len(ids))]
    assert any(p.endswith("\ufffd") for p in prefixes)  # "é" is two byte tokens here
    deltas, text = stream(tokenizer, ids, StopStrings(tokenizer.decode, ["au lx"]))
    assert "".join(deltas) == text == "café au lait"
    sent = ["".join(deltas[:i + 1]) for i in range(len(deltas))]
    for prefix, so_far in zip(prefixes[:-1], sent, strict=False):
        assert "\ufffd" not in so_far and text.startswith(so_far)
        if prefix.endswith(" a"):  # "a" could begin "au lx"
            assert so_far.endswith(" ")


def test_the_text_ends_before_the_stop_string():
    tokenizer = BPETokenizer.train("plain text only", vocab_size=260)
    deltas, text = stream(tokenizer, tokenizer.encode("to be, or not"), StopStrings(tokenizer.decode, [", o"]))
    assert text == "to be" and "".join(deltas) == text
