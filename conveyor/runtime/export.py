"""A pipeline's weights handed back as a standard model directory (``save_pretrained``).

Whatever the layout (stages on threads or ranks, replicas, FSDP shards), the directory
is what ``transformers`` writes and ``from_pretrained`` reads::

    DIR/
      model-00001-of-00002.safetensors   stage 0's tensors, by the plain model's names
      model-00002-of-00002.safetensors   stage 1's (one file, model.safetensors, for one stage)
      model.safetensors.index.json       which file holds each tensor
      config.json                        a Hugging Face model's config (and its
      generation_config.json             generation config), when the model has one
      tokenizer files                    when a tokenizer is given

Each stage's tensors are written by the first rank that holds the stage, one stage at
a time: FSDP's shards of one stage are gathered (over that stage's replicas), written and
dropped before the next, so no rank holds more than one stage's weights at once;
tensor-parallel shards are put together over their tensor group alike. A weight
several stages use (tied embeddings) is written once, under the name of the lowest
stage that holds it, as ``save_pretrained`` writes it once. The ranks agree before
anything is written: a folder that exists and is not empty is refused on every rank.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from conveyor.distributed.faults.collective import exchange
from conveyor.engine.layers import WholeStage
from conveyor.errors import ModelError, SaveError
from conveyor.graph.weights import SHARD
from conveyor.tensor.full import tensor_groups, whole_of

__all__: list[str] = []

INDEX = "model.safetensors.index.json"


def refusal(directory: Path) -> str | None:
    """Why ``directory`` cannot take an export (a file, or a folder that is not empty)."""
    if directory.is_file():
        return f"cannot export into {directory}: it is a file; name a new folder"
    if directory.is_dir() and any(directory.iterdir()):
        return (f"cannot export into {directory}: the folder exists and is not empty "
                "(nothing was written); name a new or empty folder")
    return None


def file_of(stage: int, stages: int) -> str:
    """The file of ``stage``'s tensors among ``stages``, named as transformers names them."""
    return "model.safetensors" if stages == 1 else \
        f"model-{stage + 1:05d}-of-{stages:05d}.safetensors"


def names_by_stage(pipe: nn.Module, stages: Mapping[int, Any]) -> dict[int, list[str]]:
    """The names of ``pipe.state_dict()`` each local stage holds (a tensor no stage
    reads goes with the lowest stage here); within a stage, one name per tensor."""
    held: dict[int, set[int]] = {}
    for number, stage in stages.items():
        tensors = [*stage.layers.parameters(), *stage.layers.buffers()]
        for layer in stage.layers:
            if isinstance(layer, WholeStage):
                tensors += layer.bound_parameters()
                tensors += [b for m in layer.bound_modules() for b in m.buffers(recurse=False)]
        held[number] = {id(t) for t in tensors}
    names: dict[int, list[str]] = {number: [] for number in stages}
    seen: set[int] = set()
    for name, tensor in pipe.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue  # one Parameter under two names within a stage: written once
        seen.add(id(tensor))
        owner = next((k for k in sorted(held) if id(tensor) in held[k]), min(stages))
        names[owner].append(name)
    return names


def written_once(reports: list[dict[str, Any]], ties: list[tuple[str, ...]]) -> dict[str, int]:
    """Each name to write and its stage: a name held by several stages (a tie's copy)
    under the lowest of them, and of a tie's names only those of its lowest stage."""
    stage_of: dict[str, int] = {}
    for report in reports:
        for stage, names in report["stages"].items():
            for name in names:
                stage_of[name] = min(int(stage), stage_of.get(name, int(stage)))
    for names in ties:
        present = [n for n in names if n in stage_of]
        if present:
            lowest = min(stage_of[n] for n in present)
            keep = next(n for n in present if stage_of[n] == lowest)
            for name in present:
                if name != keep:
                    del stage_of[name]
    return stage_of


def save_pretrained(pipe: nn.Module, runtime: Any, directory: str | Path, *,
                    config: Any = None, generation_config: Any = None,
                    tokenizer: Any = None) -> Path:
    """Writes the weights of ``pipe`` (run by ``runtime``) as a model directory (see the
    module's docstring); every rank of a torchrun job calls it. Returns the folder.

    Raises:
        SaveError: ``directory`` is a file or a folder that is not empty (on every rank;
            nothing written).
        ModelError: the vocabulary-parallel head is split over the ranks.
    """
    directory = Path(directory)
    topology, layout = runtime.topology, runtime.layout
    if getattr(pipe, "vocab_shards", None) is not None:
        raise ModelError("save_pretrained of a head split by vocabulary over the ranks is "
                         "not supported yet; save with conveyor.train.saving, or train "
                         "without VocabParallelCrossEntropy to export")
    local = names_by_stage(pipe, layout.stages)
    state = pipe.state_dict(keep_vars=True)
    rank = torch.distributed.get_rank() if topology.distributed else 0
    mine = {"rank": rank, "refusal": refusal(directory),
            "stages": {str(k): names for k, names in local.items()},
            "bytes": {n: state[n].numel() * state[n].element_size() * _parts(state[n])
                      for names in local.values() for n in names}}
    reports = _everyone(mine, topology, runtime, "the agreement before an export")
    refused = [r["refusal"] for r in reports if r["refusal"]]
    if refused:
        raise SaveError(refused[0])
    keep = written_once(reports, [tuple(t.names) for t in layout.ties])
    writer = {int(k): r["rank"] for r in reversed(reports) for k in r["stages"]}
    count = runtime.schedule.num_stages
    groups = tensor_groups(pipe)  # tensor-parallel shards: put together over their group
    for stage in sorted(local):  # one stage at a time: gathered, written, dropped
        tensors = {n: _whole(whole_of(state[n], groups)) for n in local[stage]
                   if keep.get(n) == stage}
        if writer[stage] == rank:
            directory.mkdir(parents=True, exist_ok=True)
            write_tensors(tensors, directory / file_of(stage, count))
        del tensors
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        sizes = {n: b for r in reports for n, b in r["bytes"].items()}
        write_metadata(directory, {n: file_of(s, count) for n, s in keep.items()}, sizes,
                       config=config, generation_config=generation_config,
                       tokenizer=tokenizer)
    _everyone(None, topology, runtime, "the barrier after an export")
    return directory


def write_metadata(directory: Path, weight_map: Mapping[str, str], sizes: Mapping[str, int],
                   *, config: Any = None, generation_config: Any = None,
                   tokenizer: Any = None) -> None:
    """The index (where there are several files), and what ``from_pretrained`` reads
    beside the weights: the config, the generation config, the tokenizer."""
    if len(set(weight_map.values())) > 1:
        index = {"metadata": {"total_size": sum(sizes.get(n, 0) for n in weight_map)},
                 "weight_map": dict(sorted(weight_map.items()))}
        (directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    for part in (config, generation_config, tokenizer):
        if part is not None:
            part.save_pretrained(directory)


def write_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """One safetensors file, with the metadata transformers looks for."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise ModelError("save_pretrained writes safetensors files: pip install "
                         "safetensors") from None
    save_file(tensors, str(path), metadata={"format": "pt"})


def _parts(tensor: torch.Tensor) -> int:
    """Of how many tensor-parallel shards ``tensor`` is one (1: it is whole)."""
    return int(getattr(tensor, SHARD, (0, 0, 1))[2])


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on the CPU, contiguous: an FSDP shard gathered over its replicas
    (a collective: every replica of the stage calls it, in the same order)."""
    full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return full.detach().to("cpu").contiguous()


def _everyone(value: Any, topology: Any, runtime: Any, what: str) -> list[Any]:
    """Every rank's ``value`` (one process: its own), through a bounded collective."""
    if not topology.distributed:
        return [value]
    return exchange(value, group=None, what=what, seconds=runtime.deadlines.opening,
                    device=topology.device if topology.device is not None and
                    torch.distributed.get_backend() == "nccl" else None)
