"""Whether a checkpoint resumes into this run: the model and data it was written for.

Tensor shapes alone do not tell models apart: a Transformer of 2 heads and one of 4 at
the same width hold the same tensors, and a checkpoint of one loads into the other and
trains on as another model. So a save records every option that defines the model
(``--layers``, ``--width``, ``--hidden``, ``--heads``, ``--length``, ``--tie``, the
vocabulary) and the data (the corpus's checksum, ``--seed``, which draws the batches),
and a resume compares them before any weight is read: a difference is refused naming
the option and both values, unless ``--allow-change`` names it. The options of the
layout and the schedule (stages, chunks, schedule, ...) may change: they are said.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from conveyor.train.checkpoints import folder, manifest
from conveyor.train.errors import CheckpointError

__all__: list[str] = []

#: Options that define the model (its function, not only its tensors' shapes); ``model``
#: is the user's model (``--model``) with a checksum of its config.
MODEL = ("model", "layers", "width", "hidden", "heads", "length", "tie", "vocab")
#: Options that define the data a step reads.
DATA = ("corpus", "seed")
#: Options that may change on resume (the same model and data, run another way).
SAFE = ("schedule", "stages", "chunks", "virtual_stages", "data_parallel", "tensor_parallel",
        "checkpoint_mode", "batch", "devices", "shard", "plan")


def identity(config: Mapping[str, Any], corpus: str, *, vocab: int = 256,
             model: str = "") -> dict[str, Any]:
    """What a checkpoint records of the model and data it was written for: ``corpus``
    (the data's checksum), ``vocab`` and ``model`` (the user's model: ``--model`` and its
    config's checksum; "" for the bundled one) beside the options."""
    values = {**config, "vocab": vocab, "corpus": corpus, "model": model}
    return {name: values[name] for name in (*MODEL, *DATA)}


def _flag(name: str, value: Any) -> str:
    if isinstance(value, bool):
        return f"--{'' if value else 'no-'}{name.replace('_', '-')}"
    if name in ("vocab", "corpus", "model"):
        return f"{name} {value}"
    return f"--{name.replace('_', '-')} {value}"


def check(saved: Mapping[str, Any], current: Mapping[str, Any], *, where: str,
          allow: Iterable[str] = ()) -> list[str]:
    """Compares the identity a checkpoint recorded (``saved``: its ``extra``) with this
    run's (``current``: :func:`identity`). Checkpoints from before the record hold
    their options (``extra["config"]``): those are compared.

    Returns:
        The changes ``allow`` let through, one phrase each (``--heads 2 -> 4``).

    Raises:
        CheckpointError: an option of the model or the data differs, naming it and both
            values, and what to pass.
    """
    recorded = dict(saved.get("identity") or {})
    if not recorded:
        recorded = {k: v for k, v in dict(saved.get("config") or {}).items() if k in MODEL}
    allowed = set(allow)
    changed = [name for name in (*MODEL, *DATA)
               if name in recorded and name in current and recorded[name] != current[name]]
    refused = [name for name in changed if name not in allowed and "all" not in allowed]
    if refused:
        said = "; ".join(f"it was written with {_flag(n, recorded[n])}, this run has "
                         f"{_flag(n, current[n])}" for n in refused)
        kind = "model" if any(n in MODEL for n in refused) else "data"
        fix = " ".join(_flag(n, recorded[n]) for n in refused
                       if n not in ("vocab", "corpus", "model"))
        raise CheckpointError(
            f"the checkpoint {where} was written for another {kind}: {said}; resuming would "
            f"train another {kind} on its weights. Resume with "
            f"{fix or 'the data it was written with'} (or leave the option out), or pass "
            f"--allow-change {','.join(refused)} to change it on purpose")
    return [f"{_flag(n, recorded[n])} -> {_flag(n, current[n])}" for n in changed]


def safe_changes(saved_config: Mapping[str, Any], config: Mapping[str, Any]) -> list[str]:
    """The options of the layout and schedule that differ from the checkpoint's run, one
    phrase each (``--schedule gpipe -> 1f1b``)."""
    return [f"--{name.replace('_', '-')} {saved_config[name]} -> {config[name]}"
            for name in SAFE if name in saved_config and name in config
            and saved_config[name] != config[name]]


def resume_notes(out: Path, config: Mapping[str, Any], current: Mapping[str, Any],
                 allow: Iterable[str] = ()) -> list[str]:
    """Checks the newest verified checkpoint in ``out`` against this run (:func:`check`)
    before any weight is read; returns the lines a resume says: how the pointer
    disagreed with the folders, the changes allowed, the safe options changed. Where
    there is no verified checkpoint, loading says why.

    Raises:
        CheckpointError: it was written for another model or data.
    """
    root = out / "checkpoint"
    found = folder.newest(root)
    if found.name is None:
        return []
    saved = manifest.from_json(manifest.read(root / found.name)["meta"])["extra"]
    notes = [found.note] if found.note else []
    allowed = check(saved, current, where=str(root / found.name), allow=allow)
    if allowed:
        notes.append("resuming with changes allowed by --allow-change: " + ", ".join(allowed))
    safe = safe_changes(dict(saved.get("config") or {}), config)
    if safe:
        notes.append(f"resuming step {saved.get('step')} with other options (the same model "
                     "and data): " + ", ".join(safe))
    return notes
