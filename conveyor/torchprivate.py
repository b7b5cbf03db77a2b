"""Every private torch name conveyor uses, in one place: when torch moves, this is the
file to read, and the oldest torch conveyor runs on is checked here, at import.

Checked on torch 2.13.0 (CPU build: ``make test``) and 2.14.1 (CUDA build on the CPU:
``make test-torch TORCH=2.14.1``), where the suite passes whole, and on 2.11.0
(``make test-torch TORCH=2.11.0``; the CUDA build of the GPU machines), where it
passes whole too (2026-12-02, docs/contributing.md). Each name below says what
conveyor needs it for.

Not moved here: ``nn.Module``'s own tables (``_modules``, ``_parameters``, ``_buffers``,
``_forward_hooks``), which conveyor reads and writes as torch's own code does, and the
name ``torch.serialization._get_layout`` that the checkpoint reader allows in a
pickle's list of globals (data, not a call).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

# The oldest torch the suite has passed on: conveyor refuses an older one at import,
# unless told to run on it untested.
MINIMUM = "2.11"
UNTESTED = "CONVEYOR_UNTESTED_TORCH"

if torch.__version__ < MINIMUM:  # TorchVersion compares with a version string
    if os.environ.get(UNTESTED) != "1":
        raise ImportError(
            f"conveyor needs torch {MINIMUM} or newer, the oldest its tests pass on; this "
            f"is torch {torch.__version__}. Upgrade it: pip install 'torch>={MINIMUM}' (or "
            f"set {UNTESTED}=1 to run on this torch untested)")
    warnings.warn(f"conveyor runs on torch {torch.__version__}, older than {MINIMUM}, the "
                  f"oldest its tests pass on ({UNTESTED}=1)", stacklevel=2)

import torch.distributed as dist  # noqa: E402
# Re-exported (F401): pytree has no public module yet (2.14); OpOverload is the type of
# torch.ops.aten.x.default; TorchDispatchMode, the base of the random-stream modes.
import torch.utils._pytree as pytree  # noqa: E402, F401
import torch.utils.checkpoint  # noqa: E402
from torch._ops import OpOverload  # noqa: E402, F401
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402, F401

__all__: list[str] = []  # the library's own helpers, none of them public

# torch.utils.checkpoint raises it through the layers to stop a recomputation early,
# once the tensors backward needs are made again; a layer's error check lets it pass.
STOP_RECOMPUTATION: type[BaseException] = getattr(
    torch.utils.checkpoint, "_StopRecomputationError", RuntimeError)

# The op torch.export leaves in a graph to assert an input's dtype and device; a traced
# stage drops it (its inputs are checked as they arrive).
assert_tensor_metadata = torch.ops.aten._assert_tensor_metadata.default

# One buffer of many tensors, and back: the bucket of data parallelism's all-reduce.
flatten_dense_tensors = _flatten_dense_tensors
unflatten_dense_tensors = _unflatten_dense_tensors


# The name of the autograd node of a torch.compile'd graph: one node whose backward
# computes the gradients of all the graph's inputs at once.
COMPILED_BACKWARD = "CompiledFunctionBackward"


# What torch.compile raises when it cannot trace or compile a function (dynamo's and
# inductor's errors, a fake-tensor run that failed), before the graph runs.
COMPILER_ERRORS = (torch._dynamo.exc.TorchDynamoException,)


def compiled_graph_count() -> int:
    """How many graphs torch.compile has made in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def inductor(graph: torch.fx.GraphModule, example_inputs: list[Any],
             inner_compile: Any) -> Any:
    """Inductor's compilation of a dynamo graph (``torch.compile``'s default backend),
    each forward and backward graph AOTAutograd partitions compiled by
    ``inner_compile(graph, example_inputs, **settings)`` (``settings["is_backward"]``
    says which), which may hand it on to :func:`inductor_graph`."""
    from torch._functorch import config
    from torch._inductor.compile_fx import compile_fx

    # AOTAutograd's cache would hand back a whole backward compiled before, by torch's
    # default backend, without calling inner_compile.
    with config.patch(enable_autograd_cache=False):
        return compile_fx(graph, example_inputs, inner_compile=inner_compile)


def recomputed_in_backward(graph: torch.fx.GraphModule) -> None:
    """Tags every op of a dynamo graph for AOTAutograd's partitioner to recompute in
    backward rather than save, as ``torch.utils.checkpoint`` inside a compiled region
    tags its own (the tags travel to the graph AOTAutograd traces from it)."""
    from torch.utils.checkpoint import CheckpointPolicy

    for node in graph.graph.nodes:
        if node.op in ("call_function", "call_method", "call_module"):
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            node.meta["ac_graph_id"] = 0


def inductor_graph(graph: torch.fx.GraphModule, example_inputs: list[Any],
                   **settings: Any) -> Any:
    """Inductor's compilation of one partitioned graph: a callable taking its inputs
    as one list (which it may empty), returning its outputs as a list."""
    from torch._inductor.compile_fx import compile_fx_inner

    return compile_fx_inner(graph, example_inputs, **settings)


def mark_dynamic(tensor: torch.Tensor, dim: int) -> None:
    """Lets torch.compile treat ``dim`` of ``tensor`` as dynamic from its first graph
    (``maybe_``: without failing where the graph makes it static)."""
    torch._dynamo.maybe_mark_dynamic(tensor, dim)


def keep_compiled_buffers() -> None:
    """Turns off torch's donated buffers for backward graphs compiled from now on (on
    this thread from torch 2.14: its settings are each thread's own). A split backward
    keeps the graph for its weight half, which donated buffers forbid."""
    from torch._functorch import config

    if getattr(config, "donated_buffer", False):
        config.donated_buffer = False


def device_of_to(*args: Any, **kwargs: Any) -> torch.device | None:
    """The device a call of ``Module.to(*args, **kwargs)`` moves to (None: none given),
    parsed as torch parses it."""
    return torch._C._nn._parse_to(*args, **kwargs)[0]


def scale_in_place(tensors: list[torch.Tensor], factor: float) -> None:
    """Multiplies each of ``tensors`` by ``factor`` in one fused call."""
    torch._foreach_mul_(tensors, factor)


def norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's Euclidean norm, in one call (``torch._foreach_norm``, which torch's
    own ``clip_grad_norm_`` uses: a kernel per device and dtype on CUDA, where a norm
    per tensor is one each; on a CPU as fast as a plain sum, where the sum of absolute
    values takes 3x), in its dtype (a 16-bit one's squares added in float32); 0 for an
    empty one."""
    return list(torch._foreach_norm(tensors, 2))


def has_gradient_hooks(parameter: torch.Tensor) -> bool:
    """Whether hooks run on ``parameter``'s gradient (``register_hook``)."""
    return bool(parameter._backward_hooks)


def fsdp_post_backward(root: torch.nn.Module) -> None:
    """Runs by hand what FSDP2 runs after a backward, for every unit under ``root``
    (``fully_shard`` applied): each parameter group's post-backward (reduce-scatter, as
    the root's settings say), then the root's end-of-backward, which resets its
    per-step state and reshards. A pipeline's backward is many autograd calls, FSDP's
    one."""
    state = root._get_fsdp_state()  # type: ignore[operator]
    for group in _fsdp_param_groups(root):
        group.post_backward()
    state._root_post_backward_final_callback()


def fsdp_lazy_init(unit: torch.nn.Module) -> None:
    """Makes an FSDP2 unit the root of its own subtree, as its first forward would: a
    unit whose ``forward`` never runs (a module a traced graph reads the parameters of)
    needs it before its post-backward is run by hand."""
    unit._get_fsdp_state()._lazy_init()  # type: ignore[operator]


def fsdp_drop_unsharded_grads(root: torch.nn.Module) -> None:
    """Drops the unsharded gradients FSDP2 accumulated under ``root`` (a failed step's)."""
    for group in _fsdp_param_groups(root):
        for param in group.fsdp_params:
            unsharded = getattr(param, "_unsharded_param", None)
            if unsharded is not None:
                unsharded.grad = None
            param.unsharded_accumulated_grad = None


def _fsdp_param_groups(root: torch.nn.Module) -> list[Any]:
    return [group for unit in root._get_fsdp_state()._state_ctx.all_states  # type: ignore[operator]
            for group in _groups_of(unit)]


def fsdp_params(unit: torch.nn.Module) -> list[Any]:
    """The FSDPParams of one FSDP2 unit (``fully_shard`` applied to it), each with its
    ``_unsharded_param`` once gathered."""
    return [param for group in _groups_of(unit._get_fsdp_state())  # type: ignore[operator]
            for param in group.fsdp_params]


def _groups_of(state: Any) -> list[Any]:
    """An FSDP2 state's parameter groups: a list of them on torch 2.13, one or None on
    2.11."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def default_store() -> dist.Store:
    """The key-value store of the default process group (torchrun's or env://)."""
    return dist.distributed_c10d._get_default_store()


def process_group_named(name: str) -> Any:
    """The process group torch registered as ``name`` (``group.group_name``): how a
    custom op, whose arguments are strings and tensors, finds its tensor group."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)  # type: ignore[arg-type]
