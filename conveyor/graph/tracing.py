"""Tracing a model with torch.export: once per model state and sample, quietly, and
with errors that name the cause.

:func:`export_model` traces ``forward`` on a sample micro-batch (non-strict, every tensor
dimension free but those the model's code fixes) and keeps the program, so that a second
pipeline of the same model on a sample of the same shapes (and the training program that
choosing the cut traced before cutting) costs nothing. The key of a kept program::

    the model object (weakly: a model collected takes its programs along)
    + its training mode, modules (objects, classes, scalar attributes, its config's)
    + every parameter and buffer (name, object, version, shape, dtype, device)
    + the call (arguments by name, each tensor's shape and dtype, other values)

A tensor written in place (an optimizer's step) counts as a change: a program is reused
only for a model exactly as it was traced. torch prints the partial graph of a failed
trace to stderr; here it goes to ``logging.getLogger("conveyor")`` at DEBUG, and the
:class:`~conveyor.errors.ModelError` says what failed, where, and what to change.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import sys
import traceback
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.export import Dim, ExportedProgram

from conveyor.errors import ModelError
from conveyor.graph.calls import CallForm, call_form, widened
from conveyor.graph.tracewatch import TraceWatch
from conveyor.torchprivate import pytree

__all__: list[str] = []

logger = logging.getLogger("conveyor")

_KEPT = 8  # programs kept per model
_programs: weakref.WeakKeyDictionary[nn.Module, OrderedDict[Any, ExportedProgram]] = (
    weakref.WeakKeyDictionary())


def traced_device(model: nn.Module) -> torch.device:
    """The device a model's tensors are on (meta if any is): the one it is traced on."""
    tensors = [*model.parameters(), *model.buffers()]
    if any(t.is_meta for t in tensors):
        return torch.device("meta")
    return tensors[0].device if tensors else torch.device("cpu")


def on_traced_device(model: nn.Module, sample: Any) -> Any:
    """``sample`` on the meta device where ``model`` is traced there (a meta model
    costs no memory to trace, and its code, a split embedding's, never meets a tensor
    of another device); else as it is."""
    if traced_device(model).type != "meta":
        return sample
    return pytree.tree_map(lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x,
                           sample)


def export_model(model: nn.Module, sample: Any) -> ExportedProgram:
    """``model``'s forward on ``sample`` (see :func:`traced_call`)."""
    return traced_call(model, sample)[0]


def traced_call(model: nn.Module, sample: Any) -> tuple[ExportedProgram, CallForm]:
    """``model``'s forward on ``sample`` as an exported graph, every tensor dimension of
    the inputs left free (export fixes those the model's code depends on; a sample of
    one row is traced on two), and how each micro-batch calls it. A program traced
    before for the model as it is and a sample of the same shapes is reused.

    Raises:
        ModelError: torch.export cannot trace the model; the message says why and what
            helps.
    """
    form = call_form(model, sample)
    args, kwargs = form.call(widened(sample))
    key = (_model_key(model), _call_key(args, kwargs))
    kept = _programs.setdefault(model, OrderedDict())
    if key in kept:
        kept.move_to_end(key)
        logger.debug("conveyor reuses the trace of %s (same model state and sample shapes)",
                     type(model).__name__)
        return kept[key], form

    def free(leaf: Any) -> Any:
        return ({d: Dim.AUTO for d in range(leaf.dim())} if isinstance(leaf, torch.Tensor)
                else None)

    arguments = (form.signature.bind(*args, **kwargs).arguments if form.signature
                 else {**{f"arg{i}": a for i, a in enumerate(args)}, **kwargs})
    dynamic = {name: pytree.tree_map(free, value) for name, value in arguments.items()}
    program = _quiet_export(model, args, kwargs, dynamic, form)
    for name, tensor in program.state_dict.items():  # conveyor reads the model's own
        program.state_dict[name] = tensor.detach().to("meta")  # (kept, they would hold
    kept[key] = program  # tensors that a rank drops alive)
    while len(kept) > _KEPT:
        kept.popitem(last=False)
    return program, form


def _quiet_export(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                  dynamic: Any, form: CallForm) -> ExportedProgram:
    """torch.export with what torch prints to stderr held back: the partial graph of a
    failed trace goes to the log at DEBUG, anything else to stderr after the trace."""
    printed = io.StringIO()
    watch = TraceWatch(model)
    try:
        with contextlib.redirect_stderr(printed), watch:
            program = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic,
                                          strict=False)
    except Exception as exc:  # noqa: BLE001 - explained and re-raised
        text = printed.getvalue()
        graph = getattr(exc, "partial_fx_graph", None)
        if isinstance(graph, str) and graph.strip():
            text = text.replace(graph + "\n", "").replace(graph, "")
            logger.debug("torch.export's partial graph of %s:\n%s", type(model).__name__,
                         graph)
        printed = io.StringIO(text)
        raise explain(model, exc, form) from exc
    finally:
        if printed.getvalue().strip():
            sys.stderr.write(printed.getvalue())
    watch.check()
    return program


def explain(model: nn.Module, exc: BaseException, form: CallForm) -> ModelError:
    """The error a user sees when tracing fails: what torch said, where, and the likely
    cause with its fix."""
    message = str(exc).strip()
    first = message.splitlines()[0] if message else ""
    name = type(model).__name__
    where, module = _where(model, exc)
    return ModelError(
        f"conveyor traces the model with torch.export to split it, and tracing {name} on "
        f"the sample failed{where}: {type(exc).__name__}: {first}\nhint: "
        f"{_hint(model, module, exc, message, form)}")


def _hint(model: nn.Module, module: nn.Module | None, exc: BaseException, message: str,
          form: CallForm) -> str:
    name = type(model).__name__
    found = re.search(r"Found <class '([\w.]+)'> in output", message)
    if found:
        kind = found.group(1).rpartition(".")[2]
        if "Cache" in kind:
            return (f"{name} returns a {kind} (use_cache=True): pass use_cache=False in the "
                    "sample and in every micro-batch, or leave use_cache out and conveyor "
                    "passes use_cache=False")
        return (f"{name} returns a {kind}, which torch.export cannot take apart: return "
                "tensors (or tuples, dicts, a ModelOutput of them), or register the class "
                "with torch.utils._pytree.register_pytree_node")
    generator = _generator_held(model, module)
    if generator and ("SymIntArrayRef" in message or "Generator" in message
                      or module is not None and generator.startswith(_name_of(model, module))):
        return (f"{generator} is a torch.Generator that the model holds, and torch.export "
                "cannot trace a draw from a generator object. Draw from torch's own "
                "generator instead (no generator=: conveyor gives each layer call and "
                "micro-batch its own stream, replayed in recomputation), or cut an "
                "nn.Sequential with balance= (run as it is, not traced: a module's own "
                "generator is then saved and restored around recomputation)")
    if "tree_name" in message:
        return (f"{name}.forward takes its inputs through **kwargs: give forward named "
                "parameters, or take them as def forward(self, *inputs) and give the sample "
                "as a tuple")
    if "data-dependent" in message or "DataDependent" in type(exc).__name__:
        return _data_dependent(model, module)
    missing = _missing_inputs(message, form)
    if missing:
        return (f"the error names {' and '.join(missing)}, which {name}.forward takes and the "
                f"sample does not give (it gives {', '.join(form.names) or 'nothing'}): add "
                f"{missing[0]} to the sample and to every micro-batch")
    return ("run torch.export.export(model, args, kwargs, strict=False) on the sample to see "
            "the whole trace (the partial graph is logged to 'conveyor' at DEBUG)")


def _missing_inputs(message: str, form: CallForm) -> list[str]:
    """The arguments of forward that the error names and the sample does not give."""
    if form.signature is None:
        return []
    given = {*form.names, *form.added}
    return [n for n in form.signature.parameters
            if n not in given and re.search(rf"\b{re.escape(n)}\b", message)
            and form.signature.parameters[n].kind not in (
                form.signature.parameters[n].VAR_KEYWORD,
                form.signature.parameters[n].VAR_POSITIONAL)]


def _generator_held(model: nn.Module, module: nn.Module | None) -> str:
    """``name.attribute`` of a torch.Generator held by ``module`` (else by any module
    of ``model``), or nothing."""
    candidates = [module] if module is not None else []
    for holder in [*candidates, *model.modules()]:
        for key, value in vars(holder).items():
            if isinstance(value, torch.Generator):
                return f"{_name_of(model, holder)}.{key}".lstrip(".")
    return ""


def _name_of(model: nn.Module, module: nn.Module) -> str:
    return next((name for name, m in model.named_modules() if m is module), "")


def _data_dependent(model: nn.Module, module: nn.Module | None) -> str:
    where = f"{type(module).__name__}.forward" if module is not None else "forward"
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.momentum is None:
        return (f"{_name_of(model, module)} ({type(module).__name__}) has momentum=None: in "
                "training it averages its running statistics cumulatively, with the factor "
                "1 / num_batches_tracked, a Python number taken from a buffer's value, which "
                "torch.export cannot trace. Give it a momentum (the default 0.1), or cut an "
                "nn.Sequential with balance= so that the layer runs as it is, not traced "
                "(its cumulative average is then exact)")
    config = getattr(model, "config", None)
    experts = getattr(config, "_experts_implementation", None)
    if experts == "eager" and hasattr(model, "set_experts_implementation"):
        return (f"data-dependent Python control flow in {where}: transformers' eager experts "
                "loop over the experts that tokens chose, which cannot be traced; call "
                "model.set_experts_implementation('batched_mm') (or pass "
                "experts_implementation='batched_mm' to from_pretrained or the config), "
                "which traces")
    return (f"data-dependent Python control flow in {where}: it branches on a tensor's "
            "values, which cannot be traced; move the branch out of forward, write it with "
            "torch.where or torch.cond, or give the model as an nn.Sequential with balance= "
            "so that the module runs whole in one stage; the partial graph is logged to "
            "'conveyor' at DEBUG")


def _where(model: nn.Module, exc: BaseException) -> tuple[str, nn.Module | None]:
    """`` in name (Type)`` of the innermost submodule whose forward the failure passed
    through, and that module; or nothing."""
    names = {id(module): name for name, module in model.named_modules()}
    found, innermost = "", None
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        module = frame.f_locals.get("self")
        name = names.get(id(module)) if isinstance(module, nn.Module) else None
        if name:
            found, innermost = f" in {name} ({type(module).__name__})", module
    return found, innermost


_SCALARS = (bool, int, float, str, type(None))


def _model_key(model: nn.Module) -> tuple[Any, ...]:
    """What a trace depends on of the model: its modules and their plain settings, its
    tensors (objects and versions), and its mode."""
    modules = []
    for name, module in model.named_modules(remove_duplicate=False):
        settings = sorted((k, v) for k, v in vars(module).items()
                          if isinstance(v, _SCALARS) and not k.startswith("_"))
        forward = getattr(module.forward, "__func__", module.forward)
        modules.append((name, id(module), type(module), id(forward), tuple(settings)))
    config = getattr(model, "config", None)
    configured = repr(sorted((k, v) for k, v in vars(config).items()
                             if isinstance(v, _SCALARS))) if config is not None else ""
    tensors = tuple((name, id(t), t._version, tuple(t.shape), t.dtype, t.device,
                     t.requires_grad)
                    for name, t in [*model.named_parameters(remove_duplicate=False),
                                    *model.named_buffers(remove_duplicate=False)])
    return (model.training, tuple(modules), configured, tensors)


def _call_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    leaves, spec = pytree.tree_flatten((args, kwargs))
    return (str(spec), tuple((tuple(leaf.shape), leaf.dtype, leaf.device, leaf.requires_grad)
                             if isinstance(leaf, torch.Tensor) else repr(leaf)
                             for leaf in leaves))


@contextlib.contextmanager
def in_mode(model: nn.Module, training: bool) -> Iterator[None]:
    """Within: ``model`` in training or eval mode, each module as the user holds it if
    that is the model's own mode (a batch norm frozen in a model that trains stays
    frozen), else after ``model.train(training)``. After: every module's mode as before."""
    modes = {module: module.training for module in model.modules()}
    try:
        if training != model.training:
            model.train(training)
        yield
    finally:
        for module, mode in modes.items():
            module.training = mode
