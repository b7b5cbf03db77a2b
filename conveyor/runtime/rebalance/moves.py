"""Moving layers between stages between two steps, with their optimizer state.

A change of balance moves the layers on either side of a boundary between adjacent
stages: ``[2, 6] -> [4, 4]`` moves layers 2 and 3 from stage 1 to stage 0. Every
stage keeps its number, device and rank; only the layers it holds change.

* In one process the stages are rebuilt from the same layer objects. A layer that
  lands on another device moves in place (the same ``Parameter`` objects, new
  storage), and the optimizer's state for it follows, so the user's optimizer stays
  valid.
* Under torchrun the rank that gives a layer away sends its state (parameters,
  buffers, gradients if any) and the optimizer's state for it to the rank that takes
  it over; that rank builds the layer as it would have at start-up (from the
  ``nn.Sequential`` every rank was given, or the layer builder), loads what came, and
  adds the parameters to its optimizer's matching group. The sender's optimizer
  forgets them. The messages go over the pipeline's process group, one per pair of
  ranks that exchange layers, each a bounded broadcast from the sender.

Then the pipeline gets a new runtime for its new stages, with a new transport and
executor (the schedule table does not depend on the balance); the step count, and a
recording under way, carry over.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from conveyor.distributed.faults import collective
from conveyor.runtime.rebalance.optimizer import adopt, move_state, release
from conveyor.runtime.runtime import Runtime
from conveyor.engine.batchnorm import convert_deferred_batch_norm
from conveyor.engine.ties import NamedLayers
from conveyor.graph.layout import Layout, build_stages
from conveyor.graph.source import LayerSource

__all__: list[str] = []


def move_layers(runtime: Runtime, owner: nn.Module, balance: Sequence[int],
                optimizer: torch.optim.Optimizer | None) -> Runtime:
    """Re-cuts the pipeline by ``balance`` between two steps (a collective under
    torchrun: every rank calls it with the same balance); returns the runtime that
    replaces ``runtime``, its layers registered on ``owner``."""
    layout = runtime.layout
    assert layout.source is not None  # checked when re-balancing was asked for
    names = layout.source.names
    old, new = _stage_of_layers(layout.balance), _stage_of_layers(balance)
    held = {stage.first_layer + j: layer
            for stage in runtime.stages.values() for j, layer in enumerate(stage.layers)}
    received: dict[int, nn.Module] = {}
    if runtime.topology.distributed:
        ranks = runtime.schedule.stage_ranks
        received = _exchange(runtime, [ranks[s] for s in old], [ranks[s] for s in new], held,
                             optimizer)
    starts = [sum(balance[:s]) for s in range(len(balance) + 1)]
    stage_layers: dict[int, NamedLayers] = {}
    for s in runtime.stages:
        device = runtime.stage_device(s)
        stage_layers[s] = [(names[i], _moved(held[i], device, optimizer) if i in held
                            else received[i]) for i in range(starts[s], starts[s + 1])]
    for name in names:  # registered again, in their new stages, by build_stages
        owner._modules.pop(name, None)
    topology = runtime.topology
    stages = build_stages(
        owner, stage_layers, names=names, first_layers={s: starts[s] for s in stage_layers},
        devices={s: runtime.stage_device(s) for s in stage_layers},
        concurrent=runtime.devices if not topology.distributed else [runtime.devices[0]],
        deferred_batch_norm=False)  # converted when first built, or when received
    return runtime.replaced(Layout(stages, list(balance), None, layout.ties,
                                   source=layout.source,
                                   deferred_batch_norm=layout.deferred_batch_norm))


def share_bytes(runtime: Runtime, data: bytes, source: int, what: str) -> bytes:
    """``data`` from pipeline rank ``source``, on every rank of the pipeline (a
    collective: every rank calls it; the others' ``data`` is ignored).

    Raises:
        PeerFailure: a rank did not join within the pipeline's opening timeout.
    """
    topology = runtime.topology
    size = torch.tensor([len(data)], dtype=torch.int64, device=runtime.device)
    src = topology.global_rank(source)
    seconds = runtime.deadlines.opening
    collective.broadcast(size, src=src, group=topology.pipeline_group, what=what,
                         seconds=seconds)
    if topology.pipeline_rank == source:
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(runtime.device)
    else:
        buffer = torch.empty(int(size.item()), dtype=torch.uint8, device=runtime.device)
    collective.broadcast(buffer, src=src, group=topology.pipeline_group, what=what,
                         seconds=seconds)
    return buffer.cpu().numpy().tobytes()


def _stage_of_layers(balance: Sequence[int]) -> list[int]:
    return [s for s, count in enumerate(balance) for _ in range(count)]


def _moved(layer: nn.Module, device: torch.device,
           optimizer: torch.optim.Optimizer | None) -> nn.Module:
    """``layer`` on ``device``, its parameters moved in place with their optimizer
    state (nothing to do on the same device)."""
    params = list(layer.parameters())
    sources = {p.device for p in params}
    if sources <= {device}:
        return layer
    layer.to(device)  # keeps the Parameter objects: the optimizer still holds them
    for source in sources:
        move_state(optimizer, params, source)
    return layer


def _exchange(runtime: Runtime, old_ranks: Sequence[int], new_ranks: Sequence[int],
              held: Mapping[int, nn.Module],
              optimizer: torch.optim.Optimizer | None) -> dict[int, nn.Module]:
    """Sends the layers this rank gives away and receives those it takes over, pair of
    ranks by pair of ranks in the same order everywhere; returns the received layers
    by index, built on this rank's device."""
    me = runtime.topology.pipeline_rank
    moving = [i for i in range(len(old_ranks)) if old_ranks[i] != new_ranks[i]]
    pairs = sorted({(old_ranks[i], new_ranks[i]) for i in moving})
    received: dict[int, nn.Module] = {}
    for source, destination in pairs:
        layers = [i for i in moving if (old_ranks[i], new_ranks[i]) == (source, destination)]
        data = _pack(layers, held, optimizer) if me == source else b""
        what = (f"the re-balance's move of layers {layers[0]}-{layers[-1]} from rank "
                f"{source} to rank {destination}")
        data = share_bytes(runtime, data, source, what)
        if me == destination:
            received.update(_unpack(runtime, data, optimizer))
    return received


def _pack(layers: Sequence[int], held: Mapping[int, nn.Module],
          optimizer: torch.optim.Optimizer | None) -> bytes:
    """The layers' state, gradients and optimizer shares, serialised; the layers leave
    this rank's optimizer."""
    payload: dict[int, Any] = {}
    for i in layers:
        layer = held[i]
        params = dict(layer.named_parameters())
        payload[i] = {
            "state": {k: v.detach().cpu() for k, v in layer.state_dict().items()},
            "grads": {k: p.grad.detach().cpu() for k, p in params.items()
                      if p.grad is not None},
            "optimizer": release(optimizer, params),
        }
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return buffer.getvalue()


def _unpack(runtime: Runtime, data: bytes,
            optimizer: torch.optim.Optimizer | None) -> dict[int, nn.Module]:
    """The layers of a received payload, built on this rank and loaded with it."""
    payload = torch.load(io.BytesIO(data), weights_only=True)
    device = runtime.topology.device or torch.device("cpu")
    source = runtime.layout.source
    assert isinstance(source, LayerSource)
    layers = {}
    for i, part in payload.items():
        # The weights come with the layer: no need to draw an initialisation seed
        # (which would advance torch's generator on this rank alone).
        layer = source.layer(i, device, 0)
        if runtime.layout.deferred_batch_norm:
            layer = convert_deferred_batch_norm(layer)
        layer.load_state_dict(part["state"])
        params = dict(layer.named_parameters())
        for name, grad in part["grads"].items():
            params[name].grad = grad.to(device)
        adopt(optimizer, params, part["optimizer"])
        layers[i] = layer
    return layers
