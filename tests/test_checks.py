"""The vocabulary of ranges in _checks: each name one interval, at its ends exactly, and the same interval
for the command line's argument types and the configs' field checks that are named after it."""

import argparse
import math

import pytest

from plainformer import _checks, cli
from plainformer.nn.lora import LoRAConfig
from plainformer.training.config import TrainConfig

NAN, INF = math.nan, math.inf

# name -> (values inside, values outside); the ends of each interval on both sides.
RANGES = {
    "positive_int": ([1, 7], [0, -1, 1.0, True, None]),
    "non_negative_int": ([0, 7], [-1, 0.0, False, "0"]),
    "seed": ([0, 2**64 - 1], [-1, 2**64, 1.0]),
    "positive_number": ([1e-300, 5, 2.5], [0, 0.0, -1.0, INF, NAN, True]),
    "non_negative_number": ([0, 0.0, 2.5], [-1e-300, INF, NAN, False]),
    "probability": ([0, 0.0, 0.5, 1 - 1e-16], [1, 1.0, -1e-300, NAN, INF, True]),
    "fraction": ([1e-300, 0.5, 1 - 1e-16], [0, 0.0, 1.0, NAN]),
    "mass": ([1e-300, 0.5, 1, 1.0], [0, 0.0, 1 + 1e-15, NAN, INF]),
}


@pytest.mark.parametrize("name", RANGES)
def test_each_range_holds_exactly_its_interval(name):
    inside, outside = RANGES[name]
    accept = getattr(_checks, f"is_{name}")
    assert all(accept(value) for value in inside)
    assert not any(accept(value) for value in outside)


def _parses(parse, text):
    try:
        parse(text)
    except argparse.ArgumentTypeError:
        return False
    return True


@pytest.mark.parametrize("name", ["positive_int", "non_negative_int", "seed", "positive_number",
                                  "non_negative_number", "probability", "fraction", "mass"])
def test_the_cli_argument_type_of_a_name_accepts_the_interval_of_that_name(name):
    inside, outside = RANGES[name]
    parse = getattr(cli, "seed_int" if name == "seed" else name)
    kind = int if name in ("positive_int", "non_negative_int", "seed") else float
    for value in inside + outside:
        if type(value) is kind or (kind is float and type(value) is int):  # what the flag's text can be
            assert _parses(parse, repr(value)) == (value in inside), (name, value)


def test_the_config_checks_refuse_what_the_ranges_refuse():
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\), got 1.0"):
        _checks.check_probability("dropout", 1.0)
    with pytest.raises(ValueError, match="n must be a positive integer, got 0"):
        _checks.check_positive_int("n", 0)
    with pytest.raises(ValueError, match="lr must be a positive finite number, got inf"):
        _checks.check_positive_number("lr", INF)
    with pytest.raises(ValueError, match=r"k must be an int >= 0, got -1"):
        _checks.check_non_negative_int("k", -1)
    assert _checks.check_probability("dropout", 0) == 0.0


def test_a_config_fields_flag_takes_the_range_declared_with_the_field():
    assert cli.ranged_field_type(LoRAConfig, "r") is cli.positive_int
    assert cli.ranged_field_type(LoRAConfig, "alpha") is cli.positive_number
    assert cli.ranged_field_type(LoRAConfig, "dropout") is cli.probability
    assert cli.ranged_field_type(TrainConfig, "min_lr") is cli.non_negative_number
    with pytest.raises(ValueError, match="dropout"):
        LoRAConfig(dropout=1.0)
    assert not _parses(cli.ranged_field_type(LoRAConfig, "dropout"), "1.0")
