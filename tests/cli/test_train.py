"""How `plainformer train` resolves a recipe, without training: the preset, the --config file and the
flags, in that order of priority; every family's recipe survives the round trip through recipe.yaml. And where
it trains: never over a run without --resume (the README's first command run twice keeps both runs)."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import yaml

from plainformer import recipes
from plainformer.cli import UserError, build_parser, main
from plainformer.cli import train as train_cli
from plainformer.cli.train import resolve
from plainformer.families import resolve as families_resolve
from plainformer.training import precision

FAST, SLOW = 1e15, 1e9  # matmul rates, FLOP/s: faster and slower than any shape's threshold but the last


@pytest.fixture(autouse=True)
def probe(monkeypatch):
    """The machine's measured matmul rate as the shape choice sees it (a fast machine unless set), and
    the list of the probes made. The CPU is one whose dtype "auto" is float32 (no AMX, slow bf16)."""
    measured, rates = [FAST], []
    monkeypatch.setattr(precision, "cpu_has_amx", lambda: False)
    monkeypatch.setattr(precision, "cpu_bf16_speedup", lambda: 0.5)

    def matmul_rate(dtype, seconds):
        rates.append(measured[0])
        return measured[0]

    monkeypatch.setattr(families_resolve, "matmul_rate", matmul_rate)
    return measured, rates


def _resolve(*argv: str, default: str = "default"):
    return resolve(build_parser().parse_args(["train", *argv]), default)


def _init(name: str) -> list[str]:
    """The --init a fine-tuning recipe without a default one needs (resolving does not read it)."""
    recipe = recipes.get(name)
    return ["--init", "some/model"] if recipe.model is None and "init" not in recipe.options else []


@pytest.mark.parametrize("name", recipes.names())
def test_the_preset_selects_model_training_and_options(name):
    run = _resolve("--preset", name, *_init(name))
    recipe = recipes.get(name)
    assert (run.family_name, run.model, run.train_config) == (recipe.family, recipe.model, recipe.train)
    init = {"init": "some/model"} if _init(name) else {}
    assert run.options == {**recipe.options, **init}
    assert run.out == Path("runs") / name


@pytest.mark.parametrize("name", recipes.names())
def test_the_written_recipe_reads_back_to_the_same_run(name, tmp_path):
    override = ("dropout", 0.1) if name != "bert-finetune" else ("attention_dropout", 0.2)
    extra = [f"--{override[0].replace('_', '-')}", str(override[1]), *_init(name)]
    run = _resolve("--preset", name, "--lr", "0.0042", "--threads", "2", *extra)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(run.recipe_values()))
    again = _resolve("--config", str(path))
    assert (again.preset, again.family_name, again.model, again.train_config) == \
        (run.preset, run.family_name, run.model, run.train_config)
    assert again.options == run.options
    if run.model is None:  # fine-tuning: only the fields given travel, the shape is --init's
        assert again.model_overrides == run.model_overrides == dict([override])


def test_flags_override_the_recipe_field_by_field():
    run = _resolve("--preset", "gpt2", "--n-layers", "2", "--max-steps", "7")
    gpt2 = recipes.get("gpt2")
    assert run.model == gpt2.model.replace(n_layers=2)
    assert run.train_config == gpt2.train.replace(max_steps=7)


def test_the_inverse_sqrt_schedule_follows_the_models_d_model_unless_given():
    assert _resolve("--preset", "seq2seq-numbers-en-fr", "--d-model", "256").train_config.schedule_d_model == 256
    given = _resolve("--preset", "seq2seq-numbers-en-fr", "--d-model", "256", "--schedule-d-model", "64")
    assert given.train_config.schedule_d_model == 64


def test_the_config_file_names_the_preset_and_the_command_line_wins(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{"preset": "nanogpt-cpu", "max_steps": 5, "lr": 0.01}')
    run = _resolve("--config", str(path), "--max-steps", "9")
    assert run.preset == "nanogpt-cpu" and run.train_config.max_steps == 9 and run.train_config.lr == 0.01
    assert _resolve("--config", str(path), "--preset", "default").preset == "default"


def test_recipe_names_the_recipe_and_preset_still_does_on_the_command_line_and_in_a_config_file(tmp_path):
    assert _resolve("--recipe", "nanogpt-cpu").preset == _resolve("--preset", "nanogpt-cpu").preset == "nanogpt-cpu"
    path = tmp_path / "c.yaml"
    path.write_text("recipe: nanogpt-cpu\nmax_steps: 5\n")
    run = _resolve("--config", str(path))
    assert run.preset == "nanogpt-cpu" and run.train_config.max_steps == 5
    path.write_text("recipe: nanogpt-cpu\npreset: gpt2\n")
    with pytest.raises(UserError, match=r"gives the recipe twice \(as preset and recipe\)$"):
        _resolve("--config", str(path))


def test_none_sets_an_optional_field_to_none_over_the_recipes_value_and_the_written_recipe_repeats_it(tmp_path):
    default = recipes.get("default")
    assert default.train.max_time is not None  # what none overrides
    run = _resolve("--max-time", "none", "--no-fit-to-time", "--sliding-window", "none", "--n-kv-heads", "2")
    assert run.train_config == default.train.replace(max_time=None, fit_to_time=False)
    assert run.model.sliding_window is None and run.model.n_kv_heads == 2
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(run.recipe_values()))
    again = _resolve("--config", str(path))
    assert (again.model, again.train_config) == (run.model, run.train_config)
    assert _resolve("--config", str(path), "--n-kv-heads", "none").model.n_kv_heads is None  # the flag wins
    multi30k = _resolve("--recipe", "multi30k-de-en", "--attention-dropout", "none")
    assert recipes.get("multi30k-de-en").model.attention_dropout == 0.0 and multi30k.model.attention_dropout is None


@pytest.mark.parametrize("argv, message", [
    (["--n-layers", "none"], "argument --n-layers: invalid int value: 'none'"),
    (["--sliding-window", "many"], "argument --sliding-window: invalid int or none value: 'many'"),
    (["--norm", "batchnorm"], "argument --norm: invalid choice: 'batchnorm' (choose from 'layernorm', 'rmsnorm')"),
])
def test_a_field_that_is_not_optional_takes_no_none_and_a_value_is_of_the_fields_type(argv, message, capsys):
    assert main(["train", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == f"plainformer: error: {message} (see `plainformer train --help`)\n"


def _shaped_recipes() -> list[str]:
    return [name for name in recipes.names() if recipes.get(name).shapes]


@pytest.mark.parametrize("name", _shaped_recipes())
def test_a_recipe_with_shapes_takes_the_one_the_measured_matmul_rate_reaches(name, probe):
    measured, rates = probe
    recipe = recipes.get(name)
    slowest_of_the_others = min(shape.min_gflops for shape in recipe.shapes[:-1])
    for rate, shape, taken in ((FAST, recipe.shapes[0], f"from {recipe.shapes[0].min_gflops:g} GFLOP/s"),
                               (SLOW, recipe.shapes[-1], f"below {slowest_of_the_others:g} GFLOP/s")):
        measured[0] = rate
        run = _resolve("--preset", name)
        assert run.model == recipe.model.replace(**shape.model)
        assert run.train_config == recipe.train.replace(**shape.train)
        assert run.shape_note == (f"shape: {shape.name} (float32 matmuls at {rate / 1e9:.0f} GFLOP/s on this "
                                  f"machine; {name!r} takes it {taken})")
    assert len(rates) == 2


@pytest.mark.parametrize("name", _shaped_recipes())
def test_a_given_shape_field_or_a_written_recipe_skips_the_probe(name, probe, tmp_path):
    measured, rates = probe
    measured[0] = SLOW
    field = sorted(recipes.get(name).shape_fields())[0]
    value = getattr(recipes.get(name).model, field, None) or getattr(recipes.get(name).train, field)
    _resolve("--preset", name, f"--{field.replace('_', '-')}", str(value))
    assert rates == []
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(_resolve("--preset", name).recipe_values()))
    again = _resolve("--config", str(path))
    assert len(rates) == 1 and again.model == recipes.get(name).model.replace(**recipes.get(name).shapes[-1].model)


def test_under_a_distributed_launch_every_process_takes_the_first_shape_without_a_probe(probe, monkeypatch):
    measured, rates = probe
    measured[0] = SLOW
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    for name in _shaped_recipes():
        assert _resolve("--preset", name).model == recipes.get(name).model.replace(**recipes.get(name).shapes[0].model)
    assert rates == []


def test_shapes_must_run_from_the_fastest_machines_to_any():
    default = recipes.get("default")
    shape = recipes.Shape("any", 0.0, {}, {})
    with pytest.raises(ValueError, match="shapes go from the fastest machines' to one for any"):
        dataclasses.replace(default, shapes=(dataclasses.replace(shape, min_gflops=1.0),))
    with pytest.raises(ValueError, match=r"got min_gflops \[0.0, 5.0\]"):
        dataclasses.replace(default, shapes=(shape, dataclasses.replace(shape, min_gflops=5.0)))


def test_the_metrics_gain_the_processes_setup_seconds_and_its_age(monkeypatch):
    monkeypatch.setattr(train_cli, "process_seconds", lambda: 10.0)
    metrics = {"step": 3, "seconds": {"steps": 5.0, "evaluation": 1.0, "other": 0.5}}
    assert train_cli.with_setup_seconds(metrics)["seconds"] == {
        "setup": 3.5, "steps": 5.0, "evaluation": 1.0, "other": 0.5, "process": 10.0}
    assert metrics["seconds"] == {"steps": 5.0, "evaluation": 1.0, "other": 0.5}  # not changed in place


def test_without_the_processes_age_the_metrics_stay_as_the_trainer_gave_them(monkeypatch):
    monkeypatch.setattr(train_cli, "process_seconds", lambda: None)
    metrics = {"step": 3, "seconds": {"steps": 5.0}}
    assert train_cli.with_setup_seconds(metrics) == metrics


# ----------------------------------------------------------------------------- the run directory

TINY = ["--max-steps", "1", "--batch-size", "2", "--eval-batches", "1", "--n-layers", "1", "--n-heads", "2",
        "--d-model", "32", "--d-ff", "64", "--block-size", "16", "--no-progress"]


def _files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("holds", ["best", "last", "recipe.yaml", "manifest.json"])
def test_a_fresh_run_into_a_directory_holding_a_run_is_refused_naming_resume_and_out(holds, run, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(run, out)
    for name in {"best", "last", "recipe.yaml"} - {"best" if holds == "manifest.json" else holds}:
        shutil.rmtree(out / name) if (out / name).is_dir() else (out / name).unlink()
    if holds == "manifest.json":  # a checkpoint directory given as --out
        out = out / "best"
    before = _files(out)
    assert main(["train", "--out", str(out), *TINY]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.splitlines() == [
        f"plainformer: error: --out {out} holds a run or checkpoint already: continue it with --resume, train a new "
        f"one with another --out, or remove {out} to start over"]
    assert _files(out) == before  # best/ (and all else) byte for byte


def test_an_out_inside_a_run_is_refused_naming_the_run(run):
    with pytest.raises(UserError, match=rf"--out {run}/logs is inside the run or checkpoint directory {run}"):
        _resolve("--out", str(run / "logs"))


def test_the_readme_command_run_twice_keeps_the_first_run_and_trains_into_the_next_name(run, tmp_path, capsys,
                                                                                         monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PLAINFORMER_CACHE", str(tmp_path / "cache"))
    first = Path("runs/default")
    shutil.copytree(run, first)  # `plainformer train` once
    (tmp_path / "runs" / "default-2").mkdir()  # a directory holding no run is taken
    before = _files(first)
    assert main(["train", *TINY]) == 0 and main(["train", *TINY]) == 0
    err = capsys.readouterr().err
    for name in ("default-2", "default-3"):
        assert (f"plainformer: runs/default holds a run already, kept; this one trains into runs/{name} (--resume "
                "continues runs/default, --out DIR names the directory)") in err
        assert (tmp_path / "runs" / name / "best").is_dir()
    assert _files(first) == before
    assert main(["sample", "--ckpt", str(first), "--prompt", "To", "--max-new-tokens", "2"]) == 0  # `&& sample`
    assert _resolve("--resume").out == first  # --resume continues the default, not a new name


@pytest.mark.parametrize("argv, message", [
    (["--sliding-window", "1000", "--block-size", "32"], "sliding_window must be at most block_size=32, the context, "
                                                         "got 1000 (None: the whole context)"),
    (["--sliding-window", "1" * 23], f"sliding_window must be at most block_size=128, the context, got {'1' * 23} "
                                     "(None: the whole context)"),
    (["--pos-encoding", "alibi", "--rope-base", "500"], "--rope-base is read by --pos-encoding rope only, not by this "
                                                        "run's --pos-encoding alibi: drop it"),
])
def test_values_checked_against_each_other_are_one_line_before_anything_is_written(argv, message, tmp_path, capsys,
                                                                                   monkeypatch):
    monkeypatch.setenv("PLAINFORMER_CACHE", str(tmp_path / "cache"))
    assert main(["train", "--out", str(tmp_path / "run"), *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.splitlines() == [f"plainformer: error: {message}"]
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()
