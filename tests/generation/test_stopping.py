"""Stop strings: where a text first holds one, and what streaming must hold back."""

from __future__ import annotations

import pytest

from plainformer.generation.stopping import StopStrings


def test_the_text_is_cut_before_the_first_stop_string_of_any():
    stop = StopStrings(lambda ids: "", ["\n\n", "THE END"])
    assert stop.cut("To be\n\nor not") == 5
    assert stop.cut("so ends THE END\n\n") == 8
    assert stop.cut("nothing here") is None


def test_streaming_holds_back_what_could_begin_a_stop_string():
    stop = StopStrings(lambda ids: "", ["THE END", "\n\n"])
    assert stop.held_back("and THE E") == 5
    assert stop.held_back("line\n") == 1
    assert stop.held_back("THE ENDING") == 0  # a whole stop string is `cut`'s to find
    assert stop.held_back("plain") == 0


@pytest.mark.parametrize("strings", ["\n", [""], [3]])
def test_stop_strings_must_be_a_list_of_non_empty_strings(strings):
    with pytest.raises(ValueError, match="stop must be a list of non-empty strings"):
        StopStrings(lambda ids: "", strings)
