"""``conveyor export CHECKPOINT DIR``: a checkpoint of ``conveyor train`` as a standard
model directory (safetensors by the plain model's names, and a Hugging Face model's
config and tokenizer files copied from ``--config``)."""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    _Commands = argparse._SubParsersAction[argparse.ArgumentParser]

__all__: list[str] = []

#: What a model directory holds beside its weights, copied from ``--config``.
BESIDE = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
          "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt",
          "merges.txt", "tokenizer.model", "chat_template.jinja")


def add_parser(commands: _Commands, run: Callable[[argparse.Namespace], int]) -> None:
    """``conveyor export`` and its flags (torch-free, like every parser)."""
    sub = commands.add_parser(
        "export", help="write a checkpoint's weights as a model directory (safetensors)",
        description="Reads the newest checkpoint in CHECKPOINT (a --out folder of conveyor "
                    "train, verified, nothing unpickled) and writes DIR, a new or empty "
                    "folder: model.safetensors by the plain model's names, and with "
                    "--config the config and tokenizer files of the model directory it "
                    "was trained from, so from_pretrained(DIR) reads it.")
    sub.add_argument("checkpoint", metavar="CHECKPOINT", help="the run's --out folder")
    sub.add_argument("directory", metavar="DIR", help="a new or empty folder")
    sub.add_argument("--config", metavar="MODEL_DIR",
                     help="a model directory (or its config.json) whose config, generation "
                          "config and tokenizer files are copied beside the weights")
    sub.set_defaults(run=run)


def export_command(args: argparse.Namespace) -> int:
    """Writes the export; an error is one line on stderr and code 2, nothing written."""
    from conveyor.errors import ConveyorError
    from conveyor.runtime.export import refusal

    out = Path(args.directory)
    try:
        refused = refusal(out)
        if refused is not None:
            raise ConveyorError(refused)
        beside = _beside(args.config)
        written = _write(args.checkpoint, out, beside)
    except ConveyorError as exc:
        print(f"conveyor export: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {written} tensors to {out / 'model.safetensors'}"
          + (f" with {', '.join(p.name for p in beside)}" if beside else ""))
    return 0


def _beside(config: str | None) -> list[Path]:
    """The files to copy from ``--config``.

    Raises:
        ConfigError: it holds no config.json.
    """
    from conveyor.errors import ConfigError

    if config is None:
        return []
    path = Path(config)
    folder = path.parent if path.name == "config.json" else path
    if not (folder / "config.json").is_file():
        raise ConfigError(f"--config {config}: there is no config.json there; give the "
                          "model directory the run was trained from")
    return [folder / name for name in BESIDE if (folder / name).is_file()]


def _write(checkpoint: str, out: Path, beside: list[Path]) -> int:
    """The newest checkpoint's weights as one safetensors file (a tensor stored under
    several names, a tie, once: under its first name), and the files beside."""
    from conveyor.runtime.export import write_tensors
    from conveyor.train import saving

    weights = saving.load_weights(checkpoint)
    tensors, seen = {}, set()
    for name, tensor in weights.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.shape)
        if key not in seen:
            seen.add(key)
            tensors[name] = tensor.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    write_tensors(tensors, out / "model.safetensors")
    for path in beside:
        shutil.copyfile(path, out / path.name)
    return len(tensors)
