"""Fine-tuning a pretrained model, whole or through LoRA: where `--init`'s model is, the model a run
starts from, and a LoRA run's model, rebuilt from the base model it names.

A LoRA run keeps no copy of its base. Its checkpoints (last/, best/) hold what it trains (the A and B of
each adapted layer and a task head, `nn.lora.adapter_state_names`), and config.json's "adapter" names
the rest:

    "adapter": {"lora": {r, alpha, dropout, targets, trainable},          the LoRAConfig
                "base": {"init": "runs/default", "path": "/abs/runs/default/best", "sha256": "..."}}

The sha256 is `files.digest.directory_sha256` of the base directory; loading the run computes it again
and refuses a base that changed, since an adapter fits only the weights it was trained on.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..checkpoint.format import Checkpoint, CheckpointError, load_checkpoint
from ..errors import UserError
from ..files.digest import directory_sha256
from ..hf.bert import MINILM_NAME, minilm_path
from ..hf.directory import is_hf_directory, read_hf_config
from ..models.family_model import FamilyModel
from ..nn.lora import LoRAConfig, adapter_state_names, add_lora
from .family import LORA_OPTIONS, Family, Run, checkpoint_dir


def base_directory(init: str) -> Path:
    """The directory of `init`: "minilm" (the packaged all-MiniLM-L6-v2), a Hugging Face directory, or a
    plainformer checkpoint or run directory (its best/, else last/)."""
    if init == MINILM_NAME:
        return minilm_path()
    path = Path(init)
    if not path.is_dir():
        raise UserError(f"--init {init}: no such model directory (give {MINILM_NAME!r}, a Hugging Face "
                        "directory, or a plainformer checkpoint or run)")
    return path if is_hf_directory(path) else checkpoint_dir(path)


def base_family(init: str) -> str:
    """The family of the model in `init`, by its files only: "bert" or "gpt" (any other plainformer
    family is returned as its checkpoint names it)."""
    directory = base_directory(init)
    if is_hf_directory(directory):
        return "bert" if read_hf_config(directory).get("model_type") == "bert" else "gpt"
    family = load_checkpoint(directory, verify=False).family
    return "bert" if family.startswith("bert") else family


def lora_config(options: Mapping[str, Any], family: Family) -> LoRAConfig | None:
    """The LoRA of a fine-tuning run's options (None without --lora-r); the family's head stays trainable."""
    if options.get("lora_r") is None:
        given = [name for name in LORA_OPTIONS if options.get(name) is not None]
        if given:
            raise UserError(f"--{given[0].replace('_', '-')} sets up LoRA, which --lora-r turns on: add --lora-r")
        return None
    values = {name.removeprefix("lora_"): options[name] for name in LORA_OPTIONS if options.get(name) is not None}
    if "targets" in values:
        values["targets"] = tuple(t.strip() for t in values["targets"].split(",") if t.strip())
    try:
        return LoRAConfig(**values, trainable=family.head)
    except (TypeError, ValueError) as error:
        raise UserError(f"--lora-{error}") from None


def starting_model(run: Run, **changes: Any) -> tuple[FamilyModel, dict[str, Any] | None]:
    """The model a fine-tuning run trains (with `.tokenizer`) and its adapter record (None when the run
    trains the whole model): --init's model with the run's model overrides and `changes`, LoRA layers
    added when the run has a LoRA; without one, every weight trains, also those of a LoRA run's model
    (merged), which its adapter kept frozen. Resumed, the model has the checkpoint's shape (the trainer
    loads its weights), on the base its adapter names."""
    family, checkpoint = run.family, run.checkpoint
    if checkpoint is not None:
        if checkpoint.adapter is not None:
            return adapted_base(checkpoint, family), checkpoint.adapter
        model = family.model(checkpoint.config(family.config))  # every family takes its config
        model.tokenizer = checkpoint.load_tokenizer()
        return model, None
    init = run.options["init"]
    directory = base_directory(init)
    model = _from_base(family, directory, {**run.model_overrides, **changes})
    lora = lora_config(run.options, family)
    if lora is None:
        return model.requires_grad_(True), None
    try:
        add_lora(model, **lora.to_dict())
    except ValueError as error:
        raise UserError(f"--lora-targets: {error}") from None
    base = {"init": init, "path": str(directory.resolve()), "sha256": directory_sha256(directory)}
    return model, {"lora": lora.to_dict(), "base": base}


def adapted_base(checkpoint: Checkpoint, family: Family) -> FamilyModel:
    """The base model a LoRA checkpoint names, checked by its sha256, in the checkpoint's config, with
    LoRA layers as the checkpoint's adapter has them (their A and B as at the start of training)."""
    assert checkpoint.adapter is not None
    config_json = checkpoint.path / "config.json"
    try:
        lora = LoRAConfig.from_dict(checkpoint.adapter["lora"])
        base = checkpoint.adapter["base"]
        init, path, sha256 = base["init"], base["path"], base["sha256"]
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(f"{config_json}: 'adapter' is malformed: {error}") from None
    if not all(isinstance(value, str) for value in (init, path, sha256)):
        raise CheckpointError(f"{config_json}: the adapter's base must name init, path and sha256 as strings")
    directory = minilm_path() if init == MINILM_NAME else Path(path)
    if not directory.is_dir():
        raise CheckpointError(f"{checkpoint.path} is a LoRA adapter of the model in {directory}, which is missing")
    if directory_sha256(directory) != sha256:
        raise CheckpointError(f"{directory} changed since the LoRA adapter in {checkpoint.path} was trained on it "
                              "(its sha256 differs from the one the adapter recorded); an adapter fits only its base")
    model = _from_base(family, directory, checkpoint.config(family.config).to_dict())
    add_lora(model, **lora.to_dict())
    return model


def _from_base(family: Family, directory: Path, changes: Mapping[str, Any]) -> FamilyModel:
    if family.from_base is None:
        raise UserError(f"the {family.name} family has no pretrained models to fine-tune")
    return family.from_base(directory, changes)


def load_trained(checkpoint: Checkpoint, family: Family) -> FamilyModel:
    """The model of a checkpoint of `family`, in eval mode with its tokenizer: a LoRA run's on its base."""
    if checkpoint.family != family.name or checkpoint.adapter is None:
        return family.model.from_loaded(checkpoint)  # which checks the family
    model = adapted_base(checkpoint, family)
    checkpoint.restore_model(model, names=adapter_state_names(model))
    if checkpoint.has_tokenizer:
        model.tokenizer = checkpoint.load_tokenizer()
    return model.eval()
