"""``compile=True``: a stage's layers compiled as one graph where none of them draws
random numbers or updates a buffer, else each layer that does neither, as the plain
model's eager forward would run them.

A stage of layers (an ``nn.Sequential`` cut) runs as one compiled graph, its
:class:`StageGraph`, in every mode (training, eval) in which a first call aside finds
that no layer draws random numbers or updates a buffer: one dynamo guard check, one
autograd node and one launch of the host's work per micro-batch instead of one per
layer. In a mode in which some layers do (dropout, batch norm in training), each other
layer is compiled on its own and those run eagerly: a layer that draws, drawing from
its own stream as the plain model's does (compiled, a random op would draw other
numbers); one that updates a buffer, as torch.compile may save the buffer itself for
backward and then write into it (backward then refuses it). A traced stage compiles
each of its graphs, but for one that draws.

A recomputed micro-batch of a stage run as one graph calls the same module compiled
again, by :func:`~conveyor.engine.compiled.backward.recomputing_backend`: the forward
keeps only its inputs, and the backward graph recomputes the rest inside itself (what
``torch.utils.checkpoint`` around the stage would do, without the second forward call
and without recomputing what no gradient reads).

Not CUDA graphs: torch's (``mode="reduce-overhead"``) replay a graph into the same
memory, where a pipeline keeps several micro-batches' outputs and saved tensors at
once; on an H200 the second micro-batch's replay overwrote the first's, and its
backward refused them.

The model's modules are left as they were: a compiled layer is called through a
:class:`CompiledCall` of conveyor's own, never by replacing its ``forward`` or adding
hooks, so that a copy of the model (``copy.deepcopy``, ``torch.save``) is the plain
model. Compiling keeps what the pipeline promises: the same random draws as the plain
model, the same memory layout of each output (:class:`EagerLayout`), no recompilation
in the middle of a step, and buffers a split backward can read twice (both by
:func:`before_compiled_call`).
"""

from __future__ import annotations

import logging
import threading
import types
import weakref
from typing import Any

import torch
from torch import nn

from conveyor.engine.compiled.backward import recomputing_backend, split_backend
from conveyor.engine.layers import Partition, WholeStage
from conveyor.torchprivate import COMPILER_ERRORS, keep_compiled_buffers, mark_dynamic, pytree

__all__: list[str] = []

_log = logging.getLogger(__name__)
_COMPILED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_thread = threading.local()


class CompiledCall:
    """Calls of ``module`` (its hooks included), compiled by torch.compile from a
    function of conveyor's own whose code object is this call's alone (named ``name``),
    with outputs handed on in eager's layout (:class:`EagerLayout`).

    Not ``nn.Module.compile``: torch.compile does not start tracing in torch's own
    files, so that of an ``nn.Linear`` or an ``nn.Sequential`` of torch's layers runs
    eagerly (torch 2.13); it keeps its graphs, and its limit of recompilations (8), per
    code object, which every module would otherwise share (from the ninth stage or
    input shape on, torch would run them eagerly); and it changes the module."""

    def __init__(self, module: nn.Module, name: str, backend: Any = split_backend) -> None:
        self.module = module
        self.name = name
        self._layout = EagerLayout()

        def call(x: Any) -> Any:
            return module(x)

        own = types.FunctionType(call.__code__.replace(co_name=name),
                                 call.__globals__, name, None, call.__closure__)
        self._compiled: Any = torch.compile(own, backend=backend)

    def __call__(self, x: Any) -> Any:
        if self._compiled is None:
            return self.module(x)
        before_compiled_call(x)
        try:
            output = self._compiled(x)
        except COMPILER_ERRORS as exc:
            # torch could not compile it (inductor's dynamic shapes refused a conv2d
            # block, generator seed 35.1): it runs eagerly from now on. The error came
            # before the graph ran; a layer that draws or updates a buffer runs eagerly
            # anyway, so running it again repeats no side effect.
            _log.warning("compile=True: torch could not compile %s, which runs eagerly: "
                         "%s", self.name, str(exc).splitlines()[0][:300])
            self._compiled = None
            return self.module(x)
        laid_out = self._layout(self.module, (x,), output)
        return output if laid_out is None else laid_out


class StageGraph(nn.Module):
    """A stage's layers as one module: its forward runs them in turn (the plain
    ``nn.Sequential``'s forward, hooks on the layers included, not the Partition's:
    the stage's call ran those). It holds the stage's :class:`Partition` but is no part
    of the model: parameters, names and state dict stay the model's."""

    def __init__(self, layers: Partition) -> None:
        super().__init__()
        self.layers = layers

    def forward(self, x: Any) -> Any:
        return self.layers.forward(x)


class CompiledStage:
    """``compile=True`` for one stage of layers: per mode (its layers' training flags),
    whether its layers run as one compiled graph or one by one, and then which of them
    run eagerly (decided at the mode's first call by
    :meth:`~conveyor.engine.stage.Stage`'s probe aside).

    Args:
        layers: the stage's layers (not a traced stage, which compiles its graphs).
        index: the stage's number (the compiled function's name).
        first_layer: the global index of its first layer.
    """

    def __init__(self, layers: Partition, *, index: int, first_layer: int) -> None:
        keep_compiled_buffers()
        self.layers = layers
        self.first_layer = first_layer
        whole = StageGraph(layers)
        self.graph = CompiledCall(whole, f"conveyor_stage_{index}")
        #: the same module compiled for a recomputed micro-batch: its forward keeps its
        #: inputs alone, its backward recomputes what the gradients need
        self.recomputing = CompiledCall(whole, f"conveyor_stage_{index}_recomputed",
                                        recomputing_backend)
        #: the layers' training flags -> the offsets of the layers that run eagerly
        #: then, those that draw random numbers or update buffers (none: the layers
        #: run as :attr:`graph`)
        self.eager: dict[tuple[bool, ...], frozenset[int]] = {}
        self._calls: dict[int, CompiledCall] = {}

    def modes(self) -> tuple[bool, ...]:
        """The layers' training flags (the Partition's own may differ: ``pipe.eval()``
        reaches the layers)."""
        return tuple(layer.training for layer in self.layers)

    def call_of(self, offset: int, modes: tuple[bool, ...]) -> CompiledCall | nn.Module:
        """How layer ``offset`` runs on its own in ``modes``: compiled, or the layer
        itself (eagerly), as one that draws random numbers or updates a buffer does."""
        layer = self.layers[offset]
        if offset in self.eager[modes]:
            return layer
        call = self._calls.get(offset)
        if call is None:
            call = self._calls[offset] = CompiledCall(
                layer, f"conveyor_layer_{self.first_layer + offset}")
        return call


def compile_stage(layers: Partition, *, index: int, first_layer: int) -> CompiledStage | None:
    """Compiles a stage (``compile=True``): a stage of layers gets a
    :class:`CompiledStage` to run them by; a traced stage compiles its graphs (None)."""
    if any(isinstance(layer, WholeStage) for layer in layers):
        compile_graphs(layers)
        return None
    return CompiledStage(layers, index=index, first_layer=first_layer)


def compile_graphs(layers: Partition) -> None:
    """Compiles each graph of a traced stage (its :class:`WholeStage`, conveyor's own
    modules) with ``torch.compile``, but for a graph that draws random numbers or
    writes into one of its inputs (a buffer), which stays eager, as such a layer does
    (see the module's notes). The stage's loop and its checks stay around the graphs,
    and so do recomputation and the ``I``/``W`` split (autograd through the compiled
    graph; see :func:`before_compiled_call`)."""
    keep_compiled_buffers()
    for layer in layers:
        assert isinstance(layer, WholeStage)
        for graph in layer.graphs():
            if graph in _COMPILED:
                continue
            if _draws_random(graph) or _writes_inputs(graph):
                _log.info("compile=True: a graph of %s draws random numbers or writes "
                          "into a buffer; it runs eagerly", layer)
                continue
            _COMPILED.add(graph)
            _COMPILED.add(layer)  # the stage's loop marks what enters it
            graph.compile(backend=split_backend)
            graph.register_forward_hook(EagerLayout())


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


def run_aside(module: nn.Module, args: tuple[Any, ...],
              updated: list[torch.Tensor] | None = None) -> Any:
    """The output of ``module``'s eager forward on ``args``, without gradient, run aside
    of the step: the random numbers it draws and the buffers it updates are put back
    (and, given ``updated``, listed there)."""
    tensors = [t for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor)]
    kept = [t for t in (*tensors, *module.buffers()) if not t.requires_grad]
    saved = [t.clone() for t in kept]
    devices = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
    with torch.no_grad(), torch.random.fork_rng(devices=devices):
        output = module.forward(*args)
        for tensor, before in zip(kept, saved):
            if not torch.equal(tensor, before):  # a buffer it updated (batch norm's)
                tensor.data.copy_(before)  # .data: saved for backward, its version stays
                if updated is not None:
                    updated.append(tensor)
    return output


def _laid_out(tensor: torch.Tensor, strides: tuple[int, ...]) -> torch.Tensor:
    """``tensor``'s values in a new tensor of ``strides``."""
    laid = torch.empty_strided(tensor.shape, strides, dtype=tensor.dtype, device=tensor.device)
    return laid.copy_(tensor)


def is_compiled(module: nn.Module) -> bool:
    """Whether :func:`compile_graphs` compiled ``module`` (a traced graph, or a stage
    of them)."""
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


def _writes_inputs(graph: torch.fx.GraphModule) -> bool:
    """Whether ``graph``, or a graph it calls (a region under ``no_grad``), calls an op
    that writes into one of that graph's inputs (a buffer's update, ``count.add_(1)``);
    in-place ops on values made inside are left alone."""
    for module in graph.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        inputs = {node for node in module.graph.nodes if node.op == "placeholder"}
        for node in module.graph.nodes:
            schema = getattr(node.target, "_schema", None)
            if node.op != "call_function" or schema is None:
                continue
            if any(argument.alias_info is not None and argument.alias_info.is_write
                   and value in inputs for argument, value in zip(schema.arguments, node.args)):
                return True
    return False


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
