"""The --config reader (cli/config_file.py): a YAML or JSON file of flag values, each typed as its flag
would parse it; a key given twice, unknown, or of the wrong type is one UserError naming the file and
the key; a file too large or holding a YAML alias is refused before its values are built. Read through
`train`'s flags (cli/train.py) and through a small table of flags of its own."""

from __future__ import annotations

import resource
import time
from pathlib import Path

import pytest

from plainformer.cli import UserError, positive_int, probability
from plainformer.cli.config_file import MAX_BYTES
from plainformer.cli.config_file import read_config_file as read_flags
from plainformer.cli.train import read_config_file

# The argparse keywords of a command's flags, as `read_flags` takes them.
FLAGS = {
    "n_layers": dict(type=int),
    "lr": dict(type=float),
    "bias": dict(type=bool),
    "out": dict(type=Path),
    "data": dict(),
    "tokenizer": dict(choices=("char", "bpe")),
    "plays": dict(nargs="+"),
    "threads": dict(type=positive_int),
    "dropout": dict(type=probability),
}


def _read(path: Path, text: str) -> dict:
    path.write_text(text, encoding="utf-8")
    return read_flags(path, FLAGS, "plainformer demo")


# ----------------------------------------------------------------------------- keys

@pytest.mark.parametrize("name, text", [
    ("c.yaml", "lr: 0.1\nn_layers: 2\nlr: 0.2\n"),
    ("c.json", '{"lr": 0.1, "n_layers": 2, "lr": 0.2}'),
    ("c.yaml", "plays:\n  a: 1\n  a: 2\n"),  # at any depth
    ("c.json", '{"plays": {"a": 1, "a": 2}}'),
], ids=["yaml", "json", "yaml nested", "json nested"])
def test_a_key_given_twice_is_refused_naming_the_key_and_the_file(name, text, tmp_path):
    key = "a" if "plays" in text else "lr"
    kind = "YAML" if name.endswith(".yaml") else "JSON"
    with pytest.raises(UserError, match=rf"c\.{name[2:]} is not valid {kind}: .*the key '{key}' is given twice"):
        _read(tmp_path / name, text)


@pytest.mark.parametrize("name, text", [("c.yaml", "n-layers: 1\nn_layers: 2\n"),
                                        ("c.json", '{"n_layers": 1, "n-layers": 2}')])
def test_a_key_given_with_dashes_and_with_underscores_is_given_twice(name, text, tmp_path):
    with pytest.raises(UserError, match=r"c\.(yaml|json) gives n_layers twice \(as n_layers and n-layers\?\)$"):
        _read(tmp_path / name, text)


def test_an_unknown_key_is_refused_with_the_closest_flag_and_the_command(tmp_path):
    with pytest.raises(UserError, match=r"^unknown key 'n_layer' in .*c\.yaml \(did you mean n_layers\?\); the keys "
                                        r"are the flags of `plainformer demo --help`$"):
        _read(tmp_path / "c.yaml", "n_layer: 2\n")
    with pytest.raises(UserError, match=r"^unknown key 'zzz' in .*c\.yaml; the keys"):
        _read(tmp_path / "c.yaml", "zzz: 2\n")


def test_a_null_value_leaves_the_flag_to_its_default(tmp_path):
    assert _read(tmp_path / "c.yaml", "lr: null\nn-layers: 2\n") == {"n_layers": 2}
    assert _read(tmp_path / "c.json", '{"lr": null, "data": "x.txt"}') == {"data": "x.txt"}


# ----------------------------------------------------------------------------- values

def test_each_value_is_typed_as_its_flag_parses_it(tmp_path):
    values = _read(tmp_path / "c.yaml", "n_layers: 3\nlr: 1e-3\nout: runs/a\nbias: false\nthreads: 2\n"
                                        "plays: [Hamlet, Macbeth]\ntokenizer: bpe\n")
    assert values == {"n_layers": 3, "lr": 1e-3, "out": Path("runs/a"), "bias": False, "threads": 2,
                      "plays": ["Hamlet", "Macbeth"], "tokenizer": "bpe"}
    assert type(values["n_layers"]) is int and type(values["lr"]) is float and isinstance(values["out"], Path)


@pytest.mark.parametrize("text, message", [
    ("n_layers: three", r"n_layers in .*c\.yaml must be int, got the string 'three'$"),
    ("n_layers: true", r"n_layers in .*c\.yaml must be an int, got bool True$"),
    ("bias: 'yes'", r"bias in .*c\.yaml must be a bool, got str 'yes'$"),
    ("tokenizer: word", r"tokenizer in .*c\.yaml must be one of char, bpe, got 'word'$"),
    ("threads: 2.0", r"threads in .*c\.yaml: expected a positive integer, got '2\.0'$"),
    ("plays: [Hamlet, 3]", r"plays in .*c\.yaml must be a list of str, got \['Hamlet', 3\]$"),
])
def test_a_value_its_flag_would_not_parse_is_refused_naming_the_key_and_the_file(text, message, tmp_path):
    with pytest.raises(UserError, match=message):
        _read(tmp_path / "c.yaml", text + "\n")


@pytest.mark.parametrize("name, text, message", [
    ("c.yaml", "n_layers: '3'", r"n_layers in .*c\.yaml must be int, got the string '3'$"),
    ("c.yaml", "lr: \"1e-3\"", r"lr in .*c\.yaml must be float, got the string '1e-3'$"),
    ("c.yaml", "dropout: '0.1'", r"dropout in .*c\.yaml must be a number, got the string '0\.1'$"),
    ("c.json", '{"threads": "2"}', r"threads in .*c\.json must be a number, got the string '2'$"),
    ("c.json", '{"lr": "0.1"}', r"lr in .*c\.json must be float, got the string '0\.1'$"),
])
def test_a_number_written_as_a_string_is_refused_as_any_other_string(name, text, message, tmp_path):
    with pytest.raises(UserError, match=message):
        _read(tmp_path / name, text)


@pytest.mark.parametrize("text, value", [("1e-3", 1e-3), ("2E5", 2e5), ("-1.5e+2", -150.0), ("1.0e-03", 1e-3)])
def test_a_yaml_float_with_an_exponent_is_a_float_without_a_dot_too(text, value, tmp_path):
    assert _read(tmp_path / "c.yaml", f"lr: {text}\n") == {"lr": value}


# ----------------------------------------------------------------------------- the file

@pytest.mark.parametrize("name, text, message", [
    ("c.yaml", "- lr\n- bias\n", r"c\.yaml must hold a mapping of flag names to values, got list$"),
    ("c.json", "3", r"c\.json must hold a mapping of flag names to values, got int$"),
    ("c.toml", "lr = 0.1\n", r"^--config must be a \.yaml, \.yml or \.json file, got .*c\.toml$"),
    ("c.yaml", "lr: [0.1\n", r"c\.yaml is not valid YAML: "),
    ("c.json", '{"lr": 0.1,}', r"c\.json is not valid JSON: "),
    ("c.json", "[" * 60_000, r"c\.json is not valid JSON: it nests too deeply to read$"),
    ("c.yaml", "[" * 60_000, r"c\.yaml is not valid YAML: it nests too deeply to read$"),
])
def test_a_file_that_is_no_mapping_of_flags_is_one_user_error_naming_it(name, text, message, tmp_path):
    with pytest.raises(UserError, match=message):
        _read(tmp_path / name, text)


def _alias_bomb(key: str) -> str:
    """Nine levels of nine aliases of the level below: 9**9 strings (387 million) written in 300 bytes."""
    levels = ["&a [" + ", ".join(['"lol"'] * 9) + "]"]
    levels += [f"&{name} [" + ", ".join([f"*{below}"] * 9) + "]"
               for below, name in zip("abcdefgh", "bcdefghi", strict=True)]
    return f"{key}: [{', '.join(levels)}]\n"


@pytest.mark.parametrize("key", ["n_layers", "dropout", "data", "plays", "unknown"])
def test_a_yaml_alias_bomb_is_refused_before_it_is_expanded(key, tmp_path):
    memory_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.process_time()
    with pytest.raises(UserError, match=r"c\.yaml is not valid YAML: an alias \(\*a\) repeats a node, which a config "
                                        r"file may not do; write the value out .*line 1"):
        _read(tmp_path / "c.yaml", _alias_bomb(key))
    # what expanding it would cost: gigabytes, minutes (issue 57 saw 1 GB at 90 s)
    assert time.process_time() - start < 5
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - memory_before < 100_000  # kB


def test_a_single_alias_is_refused_too(tmp_path):
    with pytest.raises(UserError, match=r"an alias \(\*x\) repeats a node"):
        _read(tmp_path / "c.yaml", "data: &x a.txt\nplays: [*x, Macbeth]\n")


@pytest.mark.parametrize("filler", ["# a comment\n", "data: '" + "x" * 80])
def test_a_file_larger_than_the_bound_is_refused_before_it_is_parsed(filler, tmp_path):
    text = filler * (MAX_BYTES // len(filler) + 1)
    with pytest.raises(UserError, match=r"c\.yaml is larger than a config file of flags may be \(64 KiB\)$"):
        _read(tmp_path / "c.yaml", text)
    assert _read(tmp_path / "c.yaml", "lr: 0.1\n" + "#" * (MAX_BYTES - 8)) == {"lr": 0.1}  # the bound itself reads


def test_a_flat_mapping_of_many_keys_is_refused_in_linear_time(tmp_path):
    text = "".join(f"k{i}: 1\n" for i in range(MAX_BYTES // 10))  # 6,553 keys: a quadratic check took seconds
    start = time.process_time()
    with pytest.raises(UserError, match=r"unknown key 'k0'"):
        _read(tmp_path / "c.yaml", text)
    assert time.process_time() - start < 5


def test_an_integer_of_more_digits_than_python_reads_is_one_user_error(tmp_path):
    for name, text in (("c.yaml", "n_layers: " + "9" * 5000), ("c.json", '{"n_layers": ' + "9" * 5000 + "}")):
        with pytest.raises(UserError, match=rf"c\.{name[2:]} is not valid (YAML|JSON): Exceeds the limit"):
            _read(tmp_path / name, text)


def test_a_missing_file_or_a_folder_is_named(tmp_path):
    with pytest.raises(UserError, match=r"^config file not found: .*absent\.yaml$"):
        read_flags(tmp_path / "absent.yaml", FLAGS, "plainformer demo")
    (tmp_path / "d.yaml").mkdir()
    with pytest.raises(UserError, match=r"d\.yaml is not a regular file"):
        read_flags(tmp_path / "d.yaml", FLAGS, "plainformer demo")


def test_a_utf8_byte_order_mark_is_read_past(tmp_path):
    path = tmp_path / "c.yml"
    path.write_bytes("\ufefflr: 0.5\n".encode())
    assert read_flags(path, FLAGS, "plainformer demo") == {"lr": 0.5}


# ----------------------------------------------------------------------------- with train's flags

def test_config_file_keys_take_dashes_or_underscores_and_yaml_exponents_as_numbers(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("n-layers: 3\nlr: 1e-3\ndata: some/file.txt\nbias: true\n")
    assert read_config_file(path) == {"n_layers": 3, "lr": 1e-3, "data": "some/file.txt", "bias": True}


@pytest.mark.parametrize("line, message", [
    ("plays: Macbeth", r"plays in .*c\.yaml must be a list of str, got 'Macbeth'"),
    ("data: 5", r"data in .*c\.yaml must be a str, got 5"),
    ("preset: [gpt2]", r"preset in .*c\.yaml must be a str, got \['gpt2'\]"),
    ("out: {a: 1}", r"out in .*c\.yaml must be a path \(a str\), got \{'a': 1\}"),
    ("n_layers: 2.5", r"n_layers in .*c\.yaml must be an int, got float 2\.5"),
    ("bias: 3", r"bias in .*c\.yaml must be a bool, got int 3"),
    ("lr: .nan", r"lr in .*c\.yaml must be a finite number, got nan"),
    ("threads: 0", r"threads in .*c\.yaml: expected a positive integer, got '0'"),
    ("seq_len: [3]", r"seq_len in .*c\.yaml: expected a positive integer, got '\[3\]'"),
])
def test_a_config_file_value_of_the_wrong_type_names_the_file_and_the_key(tmp_path, line, message):
    path = tmp_path / "c.yaml"
    path.write_text(line + "\n")
    with pytest.raises(UserError, match=message):
        read_config_file(path)


def test_a_config_file_that_is_not_utf8_names_the_file_and_the_byte(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes(b"preset: default\nlr: 0.001 \xe9\n")
    with pytest.raises(UserError, match=r"c\.yaml is not UTF-8 text \(byte offset 26\)"):
        read_config_file(path)
