"""``compile=True``: a stage's layers compiled one by one, as the plain model's eager
forward would run them.

Compiling keeps what the pipeline promises: the same random draws as the plain model
(dropout stays eager, a traced graph that draws random numbers stays eager whole), the
same memory layout of each output (:class:`EagerLayout`), no recompilation in the middle
of a step, and buffers a split backward can read twice (both by
:func:`before_compiled_call`).
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

import torch
from torch import nn
from torch.nn.modules.dropout import _DropoutNd

from conveyor.engine.layers import Partition, WholeStage
from conveyor.torchprivate import keep_compiled_buffers, mark_dynamic, pytree

__all__: list[str] = []

_log = logging.getLogger(__name__)
_COMPILED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_thread = threading.local()


def compile_layers(layers: Partition) -> None:
    """Compiles each layer with ``torch.compile`` (a traced stage: each of its graphs):
    parameters, names, hooks and state dict stay as they are, and so do the stage's
    loop and its checks around it, recomputation and the ``I``/``W`` split (autograd
    through the compiled graph; see :func:`before_compiled_call`). Dropout modules stay
    eager, each call a graph break, so that they draw from the pipeline's streams as
    the plain model's do; a traced graph that draws random numbers stays eager whole
    (compiled, its random ops would draw other numbers than the plain model's)."""
    keep_compiled_buffers()
    for layer in layers:
        if isinstance(layer, WholeStage):
            for graph in layer.graphs():
                if graph in _COMPILED:
                    continue
                if _draws_random(graph):
                    _log.info("compile=True: a graph of %s draws random numbers; it runs "
                              "eagerly, to draw the plain model's numbers", layer)
                    continue
                _COMPILED.add(graph)
                _COMPILED.add(layer)  # the stage's loop marks what enters it
                graph.compile()
                graph.register_forward_hook(EagerLayout())
        elif layer not in _COMPILED:
            _COMPILED.add(layer)
            for module in layer.modules():
                if isinstance(module, _DropoutNd):
                    module.forward = torch.compiler.disable(module.forward)  # type: ignore[method-assign]
            layer.compile()
            layer.register_forward_hook(EagerLayout())


class EagerLayout:
    """A forward hook that lays a compiled module's outputs out in memory as its eager
    forward does. Inductor may store an output otherwise (contiguous, where eager hands
    on a transposed view), and a random op downstream fills its mask in memory order:
    dropout would then drop other elements than the plain model's. The eager layout of
    each kind of input (shapes, strides, dtypes, training) is found once, by running
    the eager forward without gradient, its random numbers and buffers put back; an
    output laid out otherwise is copied into that layout (autograd sees a copy)."""

    def __init__(self) -> None:
        self._strides: dict[Any, list[tuple[int, ...] | None]] = {}

    @torch.compiler.disable
    def __call__(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        key = (module.training, *((t.shape, t.stride(), t.dtype) if isinstance(t, torch.Tensor)
                                  else type(t) for t in pytree.tree_leaves(args)
                                  if not isinstance(t, nn.Parameter)))
        strides = self._strides.get(key)
        if strides is None:
            strides = self._strides[key] = _eager_strides(module, args)
        leaves, spec = pytree.tree_flatten(output)
        if all(not isinstance(t, torch.Tensor) or t.stride() == want
               for t, want in zip(leaves, strides)):
            return None
        return pytree.tree_unflatten([t if not isinstance(t, torch.Tensor) or t.stride() == want
                                      or want is None else _laid_out(t, want)
                                      for t, want in zip(leaves, strides)], spec)


def _eager_strides(module: nn.Module, args: tuple[Any, ...]) -> list[tuple[int, ...] | None]:
    """The strides of each output leaf of ``module``'s eager forward on ``args`` (None:
    not a tensor)."""
    return [t.stride() if isinstance(t, torch.Tensor) else None
            for t in pytree.tree_leaves(run_aside(module, args))]


def run_aside(module: nn.Module, args: tuple[Any, ...]) -> Any:
    """The output of ``module``'s eager forward on ``args``, without gradient, run aside
    of the step: the random numbers it draws and the buffers it updates are put back."""
    tensors = [t for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor)]
    kept = [t for t in (*tensors, *module.buffers()) if not t.requires_grad]
    saved = [t.clone() for t in kept]
    devices = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
    with torch.no_grad(), torch.random.fork_rng(devices=devices):
        output = module.forward(*args)
        for tensor, before in zip(kept, saved):
            if not torch.equal(tensor, before):  # a buffer it updated (batch norm's)
                tensor.data.copy_(before)  # .data: saved for backward, its version stays
    return output


def _laid_out(tensor: torch.Tensor, strides: tuple[int, ...]) -> torch.Tensor:
    """``tensor``'s values in a new tensor of ``strides``."""
    laid = torch.empty_strided(tensor.shape, strides, dtype=tensor.dtype, device=tensor.device)
    return laid.copy_(tensor)


def is_compiled(module: nn.Module) -> bool:
    """Whether :func:`compile_layers` compiled ``module`` (a layer, or a traced graph)."""
    return module in _COMPILED


def before_compiled_call(value: Any) -> None:
    """Prepares a call of a compiled layer on ``value``, on the calling thread.

    Marks dim 0 of each tensor in ``value`` as dynamic from its first call. The last
    micro-batches of an uneven split are smaller: torch.compile would otherwise
    recompile to a dynamic graph in the middle of a step, and recomputing an earlier
    micro-batch would then run the new graph, whose saved tensors the old graph's
    backward cannot read (laid out otherwise). And turns off donated buffers on this
    thread: a split backward's ``I`` keeps the graph (``retain_graph=True``) for its
    ``W``, which donated buffers forbid. Torch reads the setting when it compiles a
    backward, at the graph's first call, on the stage's thread; up to torch 2.13 it is
    the process's, from 2.14 each thread's own."""
    if not getattr(_thread, "keeps_buffers", False):
        keep_compiled_buffers()
        _thread.keeps_buffers = True
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor) and leaf.dim():
            mark_dynamic(leaf, 0)


def _draws_random(graph: torch.fx.GraphModule) -> bool:
    """Whether ``graph`` calls an op that draws random numbers: one tagged as seeded,
    unless the graph itself fixes its probability at 0 or its training flag to False
    (Hugging Face models call dropout and attention with ``p=0.0`` where the config has
    no dropout: they draw nothing, eager or compiled)."""
    return any(node.op == "call_function"
               and torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())
               and not _draws_nothing(node)
               for node in graph.graph.nodes)


def _draws_nothing(node: torch.fx.Node) -> bool:
    """A dropout or attention call whose probability (``p``, ``dropout_p``) is the
    constant 0 or whose ``train`` is the constant False."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not any(word in schema.name for word in ("dropout", "attention")):
        return False
    given = {argument.name: value for argument, value in zip(schema.arguments, node.args)}
    given.update(node.kwargs)
    for argument in schema.arguments:
        if argument.name not in given and argument.has_default_value():
            given[argument.name] = argument.default_value
    probability = given.get("p", given.get("dropout_p"))
    if given.get("train") is False:
        return True
    return type(probability) in (int, float) and bool(probability == 0)
