"""One checkpoint format for every model family: a directory of safetensors and JSON, never a pickle.

    DIR/
      config.json             {"format_version", "family", "model": {...}, "train": {...}}
      model.safetensors       the state dict; tied weights stored once, aliases in its metadata
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
import hashlib
import json
import math
import os
import random
import shutil
import uuid
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from ..config import Config
from .atomic import reporting_full_disk

ModuleT = TypeVar("ModuleT", bound=nn.Module)

FORMAT_VERSION = 1

CONFIG = "config.json"
MODEL = "model.safetensors"
OPTIMIZER = "optimizer.safetensors"
OPTIMIZER_META = "optimizer.json"
TRAINER_STATE = "trainer_state.json"
RNG_STATE = "rng_state.safetensors"
MANIFEST = "manifest.json"
_OWN_FILES = (CONFIG, MODEL, OPTIMIZER, OPTIMIZER_META, TRAINER_STATE, RNG_STATE, MANIFEST)

_ALIASES_KEY = "plainformer.aliases"
_TMP_INFIX = ".tmp-"  # DIR's temporary sibling: .{DIR name}.tmp-{pid}-{random}

# The per-parameter state torch's Adam and AdamW keep; other optimizers get the generic checks only.
_ADAM_STATE = frozenset({"step", "exp_avg", "exp_avg_sq"})
# What each optimizer keeps per parameter once it has stepped (amsgrad's max_exp_avg_sq is allowed besides).
_KEPT_STATE = {torch.optim.Adam: _ADAM_STATE, torch.optim.AdamW: _ADAM_STATE,
               torch.optim.Muon: frozenset({"momentum_buffer"})}
# Param-group flags that choose how this optimizer runs here, not what it learned: kept, not loaded.
_IMPLEMENTATION_FLAGS = ("foreach", "fused", "capturable", "differentiable")


C = TypeVar("C", bound=Config)


class CheckpointError(ValueError):
    """A checkpoint directory is missing, incomplete, corrupted or does not fit what it is loaded into."""


# ----------------------------------------------------------------------------- saving

def save_checkpoint(directory: str | os.PathLike, *, model: nn.Module | Mapping[str, Tensor], family: str,
                    model_config: Mapping[str, Any], train_config: Mapping[str, Any] | None = None,
                    tokenizer: Any = None, optimizer: torch.optim.Optimizer | Mapping[str, Any] | None = None,
                    trainer_state: Mapping[str, Any] | None = None,
                    rng_states: Sequence[tuple[dict[str, Tensor], dict[str, Any]]] | None = None) -> Path:
    """Write a checkpoint of `model` (and optionally its tokenizer, optimizer and trainer state) to
    `directory` atomically; returns the directory.

    `trainer_state` is any JSON-serialisable mapping (the trainer stores step, data_position,
    best_val_loss, ...); when it is given, the current torch, Python `random` and numpy RNG states are
    saved with it, so that `Checkpoint.restore_rng_state()` continues the random streams exactly.
    A distributed run passes its full state dicts as `model` / `optimizer` and every rank's
    `capture_rng_state()` as `rng_states` (rank 0 first).
    """
    if not isinstance(model, (nn.Module, Mapping)):
        raise TypeError(f"model must be a torch.nn.Module or a state dict, got {type(model).__name__}")
    if not isinstance(family, str) or not family:
        raise ValueError(f"family must be a non-empty string such as 'gpt', got {family!r}")
    target = Path(directory)
    with reporting_full_disk(target, "checkpoint"):
        target.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_temporaries(target)
        tmp = target.parent / f".{target.name}{_TMP_INFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        tmp.mkdir()
        try:
            _write_contents(tmp, model=model, family=family, model_config=model_config,
                            train_config=train_config, tokenizer=tokenizer, optimizer=optimizer,
                            trainer_state=trainer_state, rng_states=rng_states)
            _write_manifest(tmp)
            _fsync_tree(tmp)
            _swap_into_place(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def _remove_stale_temporaries(target: Path) -> None:
    """Delete the temporary directories that saves killed mid-way left beside `target`: those of any
    sibling whose process is gone, and those of `target` itself from before pids were in the name."""
    for path in target.parent.glob(f".*{_TMP_INFIX}*"):
        owner = path.name.rpartition(_TMP_INFIX)[2].partition("-")[0]
        if owner.isdigit():
            if int(owner) != os.getpid() and _process_alive(int(owner)):
                continue
        elif not path.name.startswith(f".{target.name}{_TMP_INFIX}"):
            continue
        shutil.rmtree(path, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # gone, or a number no pid reaches
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _write_contents(tmp: Path, *, model, family, model_config, train_config, tokenizer, optimizer,
                    trainer_state, rng_states) -> None:
    if tokenizer is not None:
        # First, so that a tokenizer writing a file of ours (config.json, ...) is caught, not overwritten.
        tokenizer.save(tmp)
        clashes = sorted(name for name in _OWN_FILES if (tmp / name).exists())
        if clashes:
            raise ValueError(f"tokenizer.save wrote {', '.join(clashes)}, which the checkpoint "
                             "format reserves for itself")
    _write_json(tmp / CONFIG, {"format_version": FORMAT_VERSION, "family": family,
                               "model": dict(model_config), "train": dict(train_config or {})})
    tensors, aliases = _dedupe_shared(model.state_dict() if isinstance(model, nn.Module) else model)
    save_file(tensors, tmp / MODEL, metadata={"format": "pt", _ALIASES_KEY: json.dumps(aliases)})
    if optimizer is not None:
        tensors, meta = _flatten_optimizer_state(optimizer if isinstance(optimizer, Mapping)
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


def _flatten_optimizer_state(state: Mapping[str, Any]) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """{"state": {i: {name: value}}, "param_groups": [...]} -> tensors "state.{i}.{name}" + JSON rest."""
    tensors: dict[str, Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, per_param in state["state"].items():
        for name, value in per_param.items():
            if isinstance(value, Tensor):
                tensors[f"state.{index}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(index), {})[name] = value
    return tensors, {"param_groups": state["param_groups"], "scalar_state": scalars}


def capture_rng_state(cuda_devices: Sequence[int] | None = None) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """This process's torch (CPU, and CUDA `cuda_devices`, default all once initialised), Python and
    numpy RNG states, as (uint8 tensors, JSON)."""
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i in range(torch.cuda.device_count()) if cuda_devices is None else cuda_devices:
            tensors[f"torch_cuda_{i}"] = torch.cuda.get_rng_state(i)
    version, internal, gauss_next = random.getstate()
    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    return tensors, {"python": [version, list(internal), gauss_next],
                     "numpy": [name, np.asarray(keys).tolist(), pos, has_gauss, cached_gaussian]}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _write_manifest(tmp: Path) -> None:
    files = {p.name: {"sha256": _sha256(p), "size": p.stat().st_size}
             for p in sorted(tmp.iterdir()) if p.is_file()}
    _write_json(tmp / MANIFEST, {"format_version": FORMAT_VERSION, "files": files})


def _fsync_tree(directory: Path) -> None:
    for path in directory.iterdir():
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _old_path(target: Path) -> Path:
    return target.parent / f".{target.name}.old"


def _swap_into_place(tmp: Path, target: Path) -> None:
    """Rename `tmp` to `target`, keeping a complete checkpoint on disk at every instant."""
    old = _old_path(target)
    if target.exists():
        # A leftover `old` next to an existing target is a finished swap's debris; the target is whole.
        shutil.rmtree(old, ignore_errors=True)
        os.rename(target, old)
    os.rename(tmp, target)
    _fsync_dir(target.parent)
    shutil.rmtree(old, ignore_errors=True)


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

    def restore_model(self, model: ModuleT, *, prefix: str = "") -> ModuleT:
        """Load the weights into `model`, checked by `model_state_dict`."""
        try:
            model.load_state_dict(self.model_state_dict(model, prefix=prefix))
        except RuntimeError as e:
            raise CheckpointError(f"{self.path / MODEL} does not fit {type(model).__name__}: {e}") from None
        return model

    def model_state_dict(self, model: nn.Module, *, prefix: str = "") -> dict[str, Tensor]:
        """The saved weights, checked against `model`: every name must match, with the model's shape,
        and a dtype of the same kind (any float into a float tensor; integer and bool tensors exactly).

        With `prefix` ("bert." say), only the saved names that start with it are taken, without it:
        the encoder of a saved task model, leaving out its head."""
        where = f"{self.path / MODEL} does not fit {type(model).__name__}"
        saved = {name[len(prefix):]: t for name, t in self.state_dict.items() if name.startswith(prefix)}
        expected = model.state_dict()
        missing = sorted(set(expected) - set(saved))
        unexpected = sorted(set(saved) - set(expected))
        if missing or unexpected:
            raise CheckpointError(f"{where}: missing {_few(missing)}; unexpected {_few(unexpected)}")
        for name, tensor in expected.items():
            _check_like(f"{where}: {name}", saved[name], tensor, exact_dtype=False)
        return saved

    def restore_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Load state and hyperparameters into an optimizer built over the same parameters."""
        optimizer.load_state_dict(self.optimizer_state_dict(optimizer))

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The saved optimizer state in `optimizer.state_dict()` layout, checked against `optimizer`
        (built over the same parameters)."""
        if not self.has_optimizer_state:
            raise CheckpointError(f"{self.path} holds no optimizer state ({OPTIMIZER} is missing)")
        tensors = _read_safetensors(self.path / OPTIMIZER)
        meta = _read_json(self.path / OPTIMIZER_META)
        if not isinstance(meta, dict) or not isinstance(meta.get("param_groups"), list):
            raise CheckpointError(f"{self.path / OPTIMIZER_META} has no 'param_groups' list")
        groups, params = _param_groups(self.path / OPTIMIZER_META, meta["param_groups"], optimizer)
        state = _optimizer_state(self.path, tensors, meta.get("scalar_state", {}), params,
                                 _kept_state(optimizer))
        return {"state": state, "param_groups": groups}

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
            torch.set_rng_state(tensors["torch_cpu"])
            cuda = {int(name.rsplit("_", 1)[1]): t for name, t in tensors.items() if name.startswith("torch_cuda_")}
            for device, state in cuda.items():
                if torch.cuda.is_available() and device < torch.cuda.device_count():
                    torch.cuda.set_rng_state(state, device)
            version, internal, gauss_next = rng["python"]
            random.setstate((version, tuple(internal), gauss_next))
            name, keys, pos, has_gauss, cached_gaussian = rng["numpy"]
            np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss,
                                 cached_gaussian))
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"RNG state in {self.path} is malformed: {e}") from None

    def load_tokenizer(self):
        """The tokenizer saved with this checkpoint (via `plainformer.data.tokenizers.load_tokenizer`)."""
        if not self.has_tokenizer:
            raise CheckpointError(f"{self.path} holds no tokenizer (tokenizer.json is missing)")
        from ..data.tokenizers import load_tokenizer
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

    config = _read_json(path / CONFIG)
    if not isinstance(config, dict):
        raise CheckpointError(f"{path / CONFIG} must hold a JSON object, got {type(config).__name__}")
    missing = [key for key in ("format_version", "family", "model") if key not in config]
    if missing:
        raise CheckpointError(f"{path / CONFIG} lacks {', '.join(map(repr, missing))}")
    for key, kinds in (("format_version", int), ("family", str), ("model", dict), ("train", dict | None)):
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
                      trainer_state=trainer_state, format_version=config["format_version"])


def load_model(directory: str | os.PathLike, model_cls: type[ModuleT], config_cls: type[Config],
               *, map_location: str | torch.device = "cpu") -> ModuleT:
    """A trained `model_cls` (checked against its `family`) built from the saved `config_cls` and
    weights, in eval mode, with the saved tokenizer (if any) as `.tokenizer`."""
    checkpoint = load_checkpoint(directory)
    family = model_cls.family  # type: ignore[attr-defined]  # a class attribute of every model family
    if checkpoint.family != family:
        raise CheckpointError(f"checkpoint {directory} holds a {checkpoint.family!r} model, "
                              f"not a {model_cls.__name__} ({family!r})")
    model = model_cls(checkpoint.config(config_cls))
    checkpoint.restore_model(model)
    model.to(map_location)
    model.tokenizer = checkpoint.load_tokenizer() if checkpoint.has_tokenizer else None  # type: ignore[assignment]
    return model.eval()


def find_checkpoint(directory: str | os.PathLike) -> Path | None:
    """Where `load_checkpoint(directory)` reads: `directory`, or, when it is gone, the copy that a save
    interrupted between its two renames left at `.{name}.old`; None when neither is a directory."""
    directory = Path(directory)
    old = _old_path(directory)
    if not directory.exists() and old.is_dir():
        return old
    return directory if directory.is_dir() else None


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
        if file.resolve().parent != path.resolve():
            raise CheckpointError(f"{file} links outside the checkpoint directory")
        if not file.is_file():
            raise CheckpointError(f"{file} is missing (listed in {MANIFEST})")
        if not verify:
            continue
        size = file.stat().st_size
        if size != entry["size"]:
            raise CheckpointError(f"{file} is truncated or altered: {size} bytes, "
                                  f"{MANIFEST} records {entry['size']}")
        if _sha256(file) != entry["sha256"]:
            raise CheckpointError(f"{file} is corrupted: its sha256 differs from the one in {MANIFEST}")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None


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


def _check_like(where: str, saved: Tensor, expected: Tensor, *, exact_dtype: bool) -> None:
    """`saved` has `expected`'s shape, and its dtype (or, unless exact_dtype, another float dtype)."""
    if saved.shape != expected.shape:
        raise CheckpointError(f"{where} has shape {tuple(saved.shape)}, expected {tuple(expected.shape)}")
    same_kind = saved.is_floating_point() and expected.is_floating_point() and not exact_dtype
    if saved.dtype != expected.dtype and not same_kind:
        raise CheckpointError(f"{where} has dtype {saved.dtype}, expected {expected.dtype}")


def _param_groups(file: Path, saved: list, optimizer: torch.optim.Optimizer
                  ) -> tuple[list[dict[str, Any]], dict[int, Tensor]]:
    """The saved param groups checked against the optimizer's, each hyperparameter of the type the
    optimizer uses (JSON made tuples lists); and saved parameter id -> the parameter it stands for."""
    current = optimizer.param_groups
    sizes = [len(g["params"]) if isinstance(g, dict) and isinstance(g.get("params"), list) else None
             for g in saved]
    if sizes != [len(c["params"]) for c in current]:
        raise CheckpointError(f"{file} describes param groups of sizes {sizes} but the optimizer has "
                              f"{[len(c['params']) for c in current]}; build it over the same model")
    ids = [i for g in saved for i in g["params"]]
    if any(isinstance(i, bool) or not isinstance(i, int) for i in ids) or len(set(ids)) != len(ids):
        raise CheckpointError(f"{file}: the 'params' of the param groups must be distinct integers")
    groups = []
    for number, (group, ours) in enumerate(zip(saved, current, strict=True)):
        values = {"params": group["params"]}
        for key, value in ours.items():
            if key in _IMPLEMENTATION_FLAGS:
                values[key] = value
            elif key != "params":
                values[key] = _hyperparameter(f"{file}: param group {number}, {key!r}",
                                              group.get(key, value), value)
        groups.append(values)
    return groups, dict(zip(ids, (p for c in current for p in c["params"]), strict=True))


def _hyperparameter(where: str, saved: Any, ours: Any) -> Any:
    """`saved` converted to the type of `ours` (tuple for a list, a finite float for a number)."""
    def number(x: Any) -> bool:
        return not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x)

    if isinstance(ours, tuple) and isinstance(saved, (list, tuple)) and len(saved) == len(ours) \
            and all(map(number, saved)):
        return tuple(saved)
    if isinstance(ours, bool) or ours is None or isinstance(ours, str):
        ok = type(saved) is type(ours)
    else:
        ok = isinstance(ours, (int, float, Tensor)) and number(saved)
    if not ok:
        raise CheckpointError(f"{where} is {saved!r:.60}, expected a value like {ours!r:.60}")
    return saved


def _kept_state(optimizer: torch.optim.Optimizer) -> dict[int, tuple[str, frozenset[str]]]:
    """Parameter index (param_groups order) -> (optimizer name, the state it keeps per parameter), for
    the optimizers whose state is known: Adam, AdamW, Muon, also as the parts of one that steps several
    (training.optim.MuonWithAdamW, its `optimizers`)."""
    kept: dict[int, tuple[str, frozenset[str]]] = {}
    index = 0
    for part in getattr(optimizer, "optimizers", [optimizer]):
        keys = next((k for cls, k in _KEPT_STATE.items() if isinstance(part, cls)), None)
        for group in part.param_groups:
            for _ in group["params"]:
                if keys is not None:
                    kept[index] = (type(part).__name__, keys)
                index += 1
    return kept


def _optimizer_state(path: Path, tensors: Mapping[str, Tensor], scalar_state: Any, params: Mapping[int, Tensor],
                     kept: Mapping[int, tuple[str, frozenset[str]]]) -> dict[int, dict[str, Any]]:
    """{param id: {name: value}} from "state.{id}.{name}" tensors and the JSON scalars, each checked
    against its parameter: a `step` is a float scalar; every other tensor has the parameter's shape
    and dtype (torch's fused kernels read them unchecked); the state of a parameter in `kept` is complete."""
    file = path / OPTIMIZER
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        prefix, index, name = (key.split(".", 2) + ["", ""])[:3]
        if prefix != "state" or not index.isdigit() or int(index) not in params or not name:
            raise CheckpointError(f"{file} holds {key!r}, which is not 'state.{{i}}.{{name}}' for one of "
                                  f"the optimizer's {len(params)} parameters")
        where = f"{file}: {key}"
        if name == "step":
            if value.shape != () or not value.is_floating_point():
                raise CheckpointError(f"{where} must be a float scalar, got {value.dtype} of shape "
                                      f"{tuple(value.shape)}")
        else:
            _check_like(where, value, params[int(index)], exact_dtype=True)
        state.setdefault(int(index), {})[name] = value
    if not isinstance(scalar_state, dict):
        raise CheckpointError(f"{path / OPTIMIZER_META}: 'scalar_state' must be an object")
    for index, scalars in scalar_state.items():
        if not index.isdigit() or int(index) not in params or not isinstance(scalars, dict) \
                or not all(isinstance(v, (int, float, bool)) or v is None for v in scalars.values()):
            raise CheckpointError(f"{path / OPTIMIZER_META}: 'scalar_state' entry {index!r} must map "
                                  "names to numbers for one of the optimizer's parameters")
        state.setdefault(int(index), {}).update(scalars)
    for number, values in state.items():
        if number in kept and set(values) - {"max_exp_avg_sq"} != kept[number][1]:
            name, keys = kept[number]
            raise CheckpointError(f"{file}: the state of parameter {number} holds {sorted(values)}; "
                                  f"{name} keeps {sorted(keys)}")
    return state
