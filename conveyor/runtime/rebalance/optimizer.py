"""The user's optimizer following parameters that move between stages.

When a re-balance moves a layer to a stage on another device, its parameters move in
place (the same ``Parameter`` objects, new storage) and their optimizer state must go
with them: :func:`move_state`. When the layer moves to another process, the sender's
optimizer forgets the parameters (:func:`release`) and the receiver's optimizer takes
the new ``Parameter`` objects into the group with the same hyper-parameters, with the
state that came with them (:func:`adopt`). Works on any ``torch.optim.Optimizer``: it
edits ``param_groups`` and ``state``, which is what ``state_dict()`` saves.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__: list[str] = []

#: One parameter's optimizer share: its group's hyper-parameters and its state, each
#: state tensor marked with whether it lived on the parameter's device (``exp_avg``) or
#: apart from it (Adam's ``step`` on the CPU).
Share = dict[str, Any]


def move_state(optimizer: torch.optim.Optimizer | None, params: Sequence[torch.Tensor],
               source: torch.device) -> None:
    """Moves the state tensors of ``params`` that were on ``source`` to each parameter's
    device now (call it after the parameters moved)."""
    if optimizer is None:
        return
    for param in params:
        state = optimizer.state.get(param)
        if not state:
            continue
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device == source:
                state[key] = value.to(param.device)


def release(optimizer: torch.optim.Optimizer | None,
            params: Mapping[str, torch.Tensor]) -> dict[str, Share]:
    """Takes ``params`` (by name) out of ``optimizer``; returns each one's share, on the
    CPU, for the process that takes the parameter over."""
    if optimizer is None:
        return {}
    shares = {}
    for name, param in params.items():
        group = _group_of(optimizer, param)
        if group is None:
            continue
        group["params"] = [p for p in group["params"] if p is not param]
        state = optimizer.state.pop(param, {})
        shares[name] = {
            "group": {k: v for k, v in group.items() if k != "params"},
            "state": {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v
                      for k, v in state.items()},
            "on_param_device": [k for k, v in state.items()
                                if isinstance(v, torch.Tensor) and v.device == param.device],
        }
    return shares


def adopt(optimizer: torch.optim.Optimizer | None, params: Mapping[str, torch.Tensor],
          shares: Mapping[str, Share]) -> None:
    """Puts ``params`` (by name) into ``optimizer`` with the shares another process
    released: each into the group with the same hyper-parameters (a new group with them
    if there is none), with its state on the parameter's device."""
    if optimizer is None:
        return
    for name, param in params.items():
        share = shares.get(name)
        if share is None:
            continue
        group = _matching_group(optimizer, share["group"])
        if group is None:
            optimizer.add_param_group({**share["group"], "params": [param]})
        else:
            group["params"].append(param)
        state = {k: v.to(param.device) if k in share["on_param_device"] else v
                 for k, v in share["state"].items()}
        if state:
            optimizer.state[param] = state


def _group_of(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> dict[str, Any] | None:
    for group in optimizer.param_groups:
        if any(p is param for p in group["params"]):
            return group
    return None


def _matching_group(optimizer: torch.optim.Optimizer,
                    hyper: Mapping[str, Any]) -> dict[str, Any] | None:
    for group in optimizer.param_groups:
        if set(group) - {"params"} == set(hyper) and all(
                _same(group[key], value) for key, value in hyper.items()):
            return group
    return None


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.shape == b.shape and bool((a.cpu() == b.cpu()).all()))
    return bool(a == b)
