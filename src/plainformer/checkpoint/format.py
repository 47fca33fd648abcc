"""One checkpoint format for every model family: a directory of safetensors and JSON, never a pickle.

    DIR/
      config.json             {"format_version", "family", "model": {...}, "train": {...}, "adapter"?}
      model.safetensors       the state dict; tied weights stored once, aliases in its metadata.
                              A LoRA run's ("adapter" says how, and names the base model by path and
                              sha256) holds only what training changes: the adapter and what stays trainable
      tokenizer.json (+ ...)  whatever `tokenizer.save(DIR)` writes
      optimizer.safetensors   optimizer state tensors, keyed "state.{param_index}.{name}"
      optimizer.json          the optimizer's param_groups (hyperparameters) and non-tensor state
      trainer_state.json      step, data position, best val loss, ...; Python and numpy RNG states
      rng_state.safetensors   torch RNG states as uint8 tensors ("torch_cpu", "torch_cuda_{i}";
                              "rank{r}.torch_cpu", ... for the other ranks of a distributed run)
      manifest.json           sha256 and size of every other file, written last

A checkpoint is built in a temporary sibling directory, fsynced, and renamed into place. An existing
checkpoint is first renamed away to `.{name}.old` and deleted only once the new one is in place, so a
crash at any moment leaves a complete checkpoint at DIR or at `.{name}.old`; `load_checkpoint(DIR)`
falls back to the latter. Every file is checked against the manifest on load, so truncation and silent
corruption surface as a `CheckpointError` that names the file. A save also removes the temporary
directories that killed saves left beside it; a full disk is reported as one `DiskFullError` line.

A checkpoint is data from outside: every field is checked before use, and weights and optimizer state
are checked against the model and optimizer they are loaded into (names, shapes, dtypes), so a crafted
or mismatched file gives a `CheckpointError` naming the file and field, never a crash inside torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from ..config import Config
from ..data.tokenizers import load_tokenizer
from ..files.atomic import atomic_directory, reporting_full_disk, surviving
from ..files.digest import MANIFEST, sha256_file
from ..files.json_file import read_json
from .errors import CheckpointError, check_like
from .optimizer_state import flatten_optimizer_state, optimizer_state_dict
from .rng import capture_rng_state, restore_rng_state

ModuleT = TypeVar("ModuleT", bound=nn.Module)

FORMAT_VERSION = 1

CONFIG = "config.json"
MODEL = "model.safetensors"
OPTIMIZER = "optimizer.safetensors"
OPTIMIZER_META = "optimizer.json"
TRAINER_STATE = "trainer_state.json"
RNG_STATE = "rng_state.safetensors"
_OWN_FILES = (CONFIG, MODEL, OPTIMIZER, OPTIMIZER_META, TRAINER_STATE, RNG_STATE, MANIFEST)

_ALIASES_KEY = "plainformer.aliases"
C = TypeVar("C", bound=Config)


# ----------------------------------------------------------------------------- saving

def save_checkpoint(directory: str | os.PathLike, *, model: nn.Module | Mapping[str, Tensor], family: str,
                    model_config: Mapping[str, Any], train_config: Mapping[str, Any] | None = None,
                    tokenizer: Any = None, optimizer: torch.optim.Optimizer | Mapping[str, Any] | None = None,
                    trainer_state: Mapping[str, Any] | None = None,
                    rng_states: Sequence[tuple[dict[str, Tensor], dict[str, Any]]] | None = None,
                    adapter: Mapping[str, Any] | None = None) -> Path:
    """Write a checkpoint of `model` (and optionally its tokenizer, optimizer and trainer state) to
    `directory` atomically; returns the directory.

    `trainer_state` is any JSON-serialisable mapping (the trainer stores step, data_position,
    best_val_loss, ...); when it is given, the current torch, Python `random` and numpy RNG states are
    saved with it, so that `Checkpoint.restore_rng_state()` continues the random streams exactly.
    A distributed run passes its full state dicts as `model` / `optimizer` and every rank's
    `capture_rng_state()` as `rng_states` (rank 0 first). `adapter` (a JSON object) marks `model` as the
    trained part of a LoRA run on a base model kept elsewhere; it is stored in config.json.
    """
    if not isinstance(model, (nn.Module, Mapping)):
        raise TypeError(f"model must be a torch.nn.Module or a state dict, got {type(model).__name__}")
    if not isinstance(family, str) or not family:
        raise ValueError(f"family must be a non-empty string such as 'gpt', got {family!r}")
    target = Path(directory)
    with reporting_full_disk(target, "checkpoint"), atomic_directory(target) as tmp:
        _write_contents(tmp, model=model, family=family, model_config=model_config,
                        train_config=train_config, tokenizer=tokenizer, optimizer=optimizer,
                        trainer_state=trainer_state, rng_states=rng_states, adapter=adapter)
        _write_manifest(tmp)
    return target


def _write_contents(tmp: Path, *, model, family, model_config, train_config, tokenizer, optimizer,
                    trainer_state, rng_states, adapter) -> None:
    if tokenizer is not None:
        # First, so that a tokenizer writing a file of ours (config.json, ...) is caught, not overwritten.
        tokenizer.save(tmp)
        clashes = sorted(name for name in _OWN_FILES if (tmp / name).exists())
        if clashes:
            raise ValueError(f"tokenizer.save wrote {', '.join(clashes)}, which the checkpoint "
                             "format reserves for itself")
    _write_json(tmp / CONFIG, {"format_version": FORMAT_VERSION, "family": family,
                               "model": dict(model_config), "train": dict(train_config or {}),
                               **({"adapter": dict(adapter)} if adapter is not None else {})})
    tensors, aliases = _dedupe_shared(model.state_dict() if isinstance(model, nn.Module) else model)
    save_file(tensors, tmp / MODEL, metadata={"format": "pt", _ALIASES_KEY: json.dumps(aliases)})
    if optimizer is not None:
        tensors, meta = flatten_optimizer_state(optimizer if isinstance(optimizer, Mapping)
                                                 else optimizer.state_dict())
        save_file(tensors, tmp / OPTIMIZER)
        _write_json(tmp / OPTIMIZER_META, meta)
    if trainer_state is not None:
        (rng_tensors, rng_json), *others = rng_states or [capture_rng_state()]
        for rank, (other_tensors, _) in enumerate(others, start=1):
            rng_tensors.update({f"rank{rank}.{name}": t for name, t in other_tensors.items()})
        extra = {"rng_other_ranks": [other_json for _, other_json in others]} if others else {}
        save_file(rng_tensors, tmp / RNG_STATE)
        _write_json(tmp / TRAINER_STATE, {**dict(trainer_state), "rng": rng_json, **extra})


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True, allow_nan=True) + "\n")


def _dedupe_shared(state_dict: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Store each shared tensor once: safetensors refuses two names for one storage.

    Names that are the same view of the same storage (tied weights) become aliases of the first name;
    tensors that merely overlap another's storage are cloned, since they are not the same tensor.
    """
    tensors: dict[str, Tensor] = {}
    aliases: dict[str, str] = {}
    first_name_of_view: dict[tuple, str] = {}
    storages_seen: set[int] = set()
    for name, tensor in state_dict.items():
        tensor = tensor.detach()
        if tensor.numel() == 0:
            tensors[name] = tensor.cpu().contiguous()
            continue
        ptr = tensor.untyped_storage().data_ptr()
        view = (ptr, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
        if view in first_name_of_view:
            aliases[name] = first_name_of_view[view]
            continue
        first_name_of_view[view] = name
        shares_storage = ptr in storages_seen
        storages_seen.add(ptr)
        tensor = tensor.cpu()
        tensors[name] = (tensor.clone(memory_format=torch.contiguous_format) if shares_storage
                         else tensor.contiguous())
    return tensors, aliases


def _write_manifest(tmp: Path) -> None:
    files = {p.name: {"sha256": sha256_file(p), "size": p.stat().st_size}
             for p in sorted(tmp.iterdir()) if p.is_file()}
    _write_json(tmp / MANIFEST, {"format_version": FORMAT_VERSION, "files": files})


# ----------------------------------------------------------------------------- loading

@dataclasses.dataclass
class Checkpoint:
    """A loaded checkpoint. `state_dict` is ready for `model.load_state_dict` (tied names share one
    tensor); optimizer, RNG and tokenizer are read from `path` only when asked for."""

    path: Path
    family: str
    model_config: dict[str, Any]
    train_config: dict[str, Any]
    state_dict: dict[str, Tensor]
    trainer_state: dict[str, Any] | None
    format_version: int = FORMAT_VERSION
    adapter: dict[str, Any] | None = None  # a LoRA run's: its LoRA config and base model

    @property
    def has_optimizer_state(self) -> bool:
        return (self.path / OPTIMIZER).exists()

    @property
    def has_tokenizer(self) -> bool:
        return (self.path / "tokenizer.json").exists()

    def config(self, config_cls: type[C], part: str = "model") -> C:
        """The saved "model" (or "train") config as a `config_cls`, checked by it; a CheckpointError
        naming config.json and the field when the file's values do not fit."""
        values = self.model_config if part == "model" else self.train_config
        try:
            return config_cls.from_dict(values)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{self.path / CONFIG}: '{part}' does not fit {config_cls.__name__}: {e}") from None

    def restore_model(self, model: ModuleT, *, prefix: str = "", names: Collection[str] | None = None
                      ) -> ModuleT:
        """Load the weights into `model`, checked by `model_state_dict` (with `names`: those only)."""
        try:
            model.load_state_dict(self.model_state_dict(model, prefix=prefix, names=names), strict=names is None)
        except RuntimeError as e:
            raise CheckpointError(f"{self.path / MODEL} does not fit {type(model).__name__}: {e}") from None
        return model

    def model_state_dict(self, model: nn.Module, *, prefix: str = "",
                         names: Collection[str] | None = None) -> dict[str, Tensor]:
        """The saved weights, checked against `model`: every name must match, with the model's shape,
        and a dtype of the same kind (any float into a float tensor; integer and bool tensors exactly).

        With `prefix` ("bert." say), only the saved names that start with it are taken, without it:
        the encoder of a saved task model, leaving out its head. With `names`, the saved names must be
        those of the model's state dict (a LoRA run's adapter and what it trains), as they must be for a
        checkpoint with an `adapter`, which holds only part of a model."""
        where = f"{self.path / MODEL} does not fit {type(model).__name__}"
        if self.adapter is not None and names is None:
            raise CheckpointError(f"{self.path} holds only the LoRA adapter of a model whose base config.json "
                                  "names; load it with pf.load_model or a plainformer command's --ckpt")
        saved = {name[len(prefix):]: t for name, t in self.state_dict.items() if name.startswith(prefix)}
        expected = model.state_dict()
        if names is not None:
            expected = {name: expected[name] for name in names}
        missing = sorted(set(expected) - set(saved))
        unexpected = sorted(set(saved) - set(expected))
        if missing or unexpected:
            raise CheckpointError(f"{where}: missing {_few(missing)}; unexpected {_few(unexpected)}")
        for name, tensor in expected.items():
            check_like(f"{where}: {name}", saved[name], tensor, exact_dtype=False)
        return saved

    def restore_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Load state and hyperparameters into an optimizer built over the same parameters."""
        optimizer.load_state_dict(self.optimizer_state_dict(optimizer))

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The saved optimizer state in `optimizer.state_dict()` layout, checked against `optimizer`
        (built over the same parameters)."""
        if not self.has_optimizer_state:
            raise CheckpointError(f"{self.path} holds no optimizer state ({OPTIMIZER} is missing)")
        return optimizer_state_dict(self.path / OPTIMIZER, self.path / OPTIMIZER_META,
                                    _read_safetensors(self.path / OPTIMIZER),
                                    _read_json(self.path / OPTIMIZER_META), optimizer)

    @property
    def rng_ranks(self) -> int:
        """How many ranks' RNG states this holds (1 for a single-process run, 0 without any)."""
        if self.trainer_state is None or "rng" not in self.trainer_state:
            return 0
        return 1 + len(self.trainer_state.get("rng_other_ranks", []))

    def restore_rng_state(self, rank: int = 0) -> None:
        """Set the torch, Python `random` and numpy RNGs to where they were on `rank` when this was saved."""
        if not 0 <= rank < max(self.rng_ranks, 1):
            raise CheckpointError(f"{self.path} holds the RNG states of {self.rng_ranks} ranks, not of rank {rank}")
        if self.trainer_state is None or "rng" not in self.trainer_state:
            raise CheckpointError(f"{self.path} holds no RNG state ({TRAINER_STATE} is missing)")
        prefix = f"rank{rank}." if rank else ""
        tensors = {name[len(prefix):]: t for name, t in _read_safetensors(self.path / RNG_STATE).items()
                   if name.startswith(prefix) and (rank or not name.startswith("rank"))}
        rng = self.trainer_state["rng"] if rank == 0 else self.trainer_state["rng_other_ranks"][rank - 1]
        try:
            restore_rng_state(tensors, rng)
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"RNG state in {self.path} is malformed: {e}") from None

    def load_tokenizer(self):
        """The tokenizer saved with this checkpoint (via `plainformer.data.tokenizers.load_tokenizer`)."""
        if not self.has_tokenizer:
            raise CheckpointError(f"{self.path} holds no tokenizer (tokenizer.json is missing)")
        return load_tokenizer(self.path)


def load_checkpoint(directory: str | os.PathLike, *, verify: bool = True) -> Checkpoint:
    """Read a checkpoint written by `save_checkpoint`. Nothing is unpickled.

    With `verify` (the default) every file's size and sha256 are checked against manifest.json first.
    If `directory` is gone but the copy a crashed save renamed away is there, that copy is loaded.
    Raises CheckpointError naming the file and the fault.
    """
    path = _locate(Path(directory))
    manifest = _read_json(path / MANIFEST)
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        raise CheckpointError(f"{path / MANIFEST} has no 'files' table")
    for required in (CONFIG, MODEL):
        if required not in files:
            raise CheckpointError(f"{path / MANIFEST} does not list {required}")
    _check_files(path, files, verify=verify)
    _refuse_unlisted(path, files)

    config = _read_json(path / CONFIG)
    if not isinstance(config, dict):
        raise CheckpointError(f"{path / CONFIG} must hold a JSON object, got {type(config).__name__}")
    missing = [key for key in ("format_version", "family", "model") if key not in config]
    if missing:
        raise CheckpointError(f"{path / CONFIG} lacks {', '.join(map(repr, missing))}")
    for key, kinds in (("format_version", int), ("family", str), ("model", dict), ("train", dict | None),
                       ("adapter", dict | None)):
        _check_field(path / CONFIG, key, config.get(key), kinds)
    if config["format_version"] > FORMAT_VERSION:
        raise CheckpointError(f"{path} has format_version {config['format_version']}; this plainformer "
                              f"reads up to {FORMAT_VERSION}: upgrade plainformer")
    trainer_state = _read_json(path / TRAINER_STATE) if TRAINER_STATE in files else None
    if trainer_state is not None and not isinstance(trainer_state, dict):
        raise CheckpointError(f"{path / TRAINER_STATE} must hold a JSON object, "
                              f"got {type(trainer_state).__name__}")
    return Checkpoint(path=path, family=config["family"], model_config=config["model"],
                      train_config=config.get("train") or {}, state_dict=_read_model(path / MODEL),
                      trainer_state=trainer_state, format_version=config["format_version"],
                      adapter=config.get("adapter"))


def find_checkpoint(directory: str | os.PathLike) -> Path | None:
    """Where `load_checkpoint(directory)` reads: `directory`, or, when it is gone, the copy that a save
    interrupted between its two renames left at `.{name}.old`; None when neither is a directory."""
    return surviving(directory)


def _locate(directory: Path) -> Path:
    found = find_checkpoint(directory)
    if found is not None and found != directory:
        warnings.warn(f"{directory} is missing; loading {found}, left by a save that was interrupted",
                      stacklevel=3)
        directory = found
    if not directory.exists():
        raise CheckpointError(f"no checkpoint at {directory}: the directory does not exist")
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is a file, not a checkpoint directory")
    if not (directory / MANIFEST).exists():
        raise CheckpointError(f"{directory} is not a plainformer checkpoint: {MANIFEST} is missing")
    return directory


def _check_files(path: Path, files: Mapping[str, Any], *, verify: bool) -> None:
    for name, entry in files.items():
        if name in ("", ".", "..") or any(c in name for c in "/\\\0"):
            raise CheckpointError(f"{path / MANIFEST} lists {name!r}, which is not a file name inside "
                                  "the checkpoint directory")
        if (not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str)
                or isinstance(entry.get("size"), bool) or not isinstance(entry.get("size"), int)):
            raise CheckpointError(f"{path / MANIFEST}: the entry of {name!r} must be an object with an "
                                  f"integer 'size' and a 'sha256' string, got {entry!r:.100}")
        file = path / name
        if file.is_symlink() or file.resolve().parent != path.resolve():
            raise CheckpointError(f"{file} is a link: every file of a checkpoint is its own, inside its directory")
        if not file.is_file():
            raise CheckpointError(f"{file} is missing (listed in {MANIFEST})")
        if not verify:
            continue
        size = file.stat().st_size
        if size != entry["size"]:
            raise CheckpointError(f"{file} is truncated or altered: {size} bytes, "
                                  f"{MANIFEST} records {entry['size']}")
        if sha256_file(file) != entry["sha256"]:
            raise CheckpointError(f"{file} is corrupted: its sha256 differs from the one in {MANIFEST}")


def _refuse_unlisted(path: Path, files: Mapping[str, Any]) -> None:
    """Every file a checkpoint holds is one the manifest lists (and so verifies): a file put beside
    them (a tokenizer.json, optimizer state) would otherwise be read unchecked. Hidden files are not
    the checkpoint's."""
    unlisted = sorted(p.name for p in path.iterdir() if not p.name.startswith(".") and p.name != MANIFEST
                      and p.name not in files)
    if unlisted:
        raise CheckpointError(f"{path / unlisted[0]} is not listed in {MANIFEST}: a checkpoint reads only the "
                              "files its manifest verifies (remove it, or save the checkpoint again)")


def _read_json(path: Path) -> Any:
    return read_json(path, error=CheckpointError)


def _read_safetensors(path: Path) -> dict[str, Tensor]:
    try:
        return load_file(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path} could not be read as safetensors: {e}") from None


def _read_model(path: Path) -> dict[str, Tensor]:
    tensors = _read_safetensors(path)
    with safe_open(path, "pt") as f:
        metadata = f.metadata() or {}
    try:
        aliases = json.loads(metadata.get(_ALIASES_KEY, "{}"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} has malformed alias metadata: {e}") from None
    if not isinstance(aliases, dict) or not all(isinstance(v, str) for v in aliases.values()):
        raise CheckpointError(f"{path}: the metadata {_ALIASES_KEY!r} must map names to names, "
                              f"got {aliases!r:.100}")
    for alias, name in aliases.items():
        if alias in tensors:
            raise CheckpointError(f"{path}: the metadata {_ALIASES_KEY!r} ties {alias!r}, which the file holds "
                                  "itself, to another tensor")
        if name not in tensors:
            raise CheckpointError(f"{path} says {alias!r} is tied to {name!r}, which it does not hold")
        tensors[alias] = tensors[name]
    return tensors


# ----------------------------------------------------------------------------- validation

def _few(names: list[str]) -> str:
    return (", ".join(names[:5]) + (" ..." if len(names) > 5 else "")) or "none"


def _check_field(file: Path, key: str, value: Any, kinds: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise CheckpointError(f"{file}: {key!r} has the wrong type ({type(value).__name__}): {value!r:.100}")
