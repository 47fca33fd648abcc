"""Stop strings: a row of generated text ends where it first contains one of them.

The text is the decoding of the row's new tokens, read after every token: a stop string may end in
the middle of a token (byte-level BPE merges across it), so the row's tokens run up to the one that
completes it, and the text printed ends before it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class StopStrings:
    """`strings` (each non-empty) in the texts `decode(new token ids)` gives."""

    def __init__(self, decode: Callable[[list[int]], str], strings: Sequence[str]):
        if isinstance(strings, str) or not all(isinstance(s, str) and s for s in strings):
            raise ValueError(f"stop must be a list of non-empty strings, got {strings!r}")
        self.decode, self.strings = decode, tuple(strings)

    def __bool__(self) -> bool:
        return bool(self.strings)

    def cut(self, text: str) -> int | None:
        """Where `text` first holds a stop string (the text before it is kept); None if nowhere."""
        found = [i for i in (text.find(s) for s in self.strings) if i >= 0]
        return min(found) if found else None

    def held_back(self, text: str) -> int:
        """How many characters at the end of `text` could begin a stop string: what streaming must
        hold back until the next token says."""
        longest = 0
        for stop in self.strings:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
