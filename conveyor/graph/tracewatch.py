"""What torch.export drops without a word, watched while it traces a model.

A traced pipeline runs the graph torch.export made, not the model's Python. Two things
the plain model does are not in that graph, and a pipeline built on it would train
differently without any error:

* **state rebound in forward** (``self.count = self.count + 1``, ``self.calls += 1``,
  ``self.cache = x.detach()``), or a Python container changed in place (a list
  appended to, a dict counted): the graph reads the value of trace time for ever (an
  update in place, ``self.count.add_(1)``, is recorded and kept). An attribute a
  module lists in ``conveyor_harmless`` is left alone;
* **a custom autograd.Function**: export inlines its forward and drops its backward,
  so the graph's gradient is autograd's derivative of the forward. For a Function whose
  backward is that derivative (a fused or hand-written one, as Bloom's GELU) nothing
  changes; for one whose backward is another (a straight-through estimator, gradient
  reversal or clipping) the gradient would be wrong.

:class:`TraceWatch` notes both while export runs, then refuses the first and checks the
second: each Function seen is run on random inputs of the shapes it was traced with,
and its backward compared with autograd's gradient of its forward. A Function that
differs, or that cannot be run so, is refused, naming it and the way out.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn

from conveyor.errors import ModelError
from conveyor.torchprivate import pytree

__all__: list[str] = []

_PLAIN = (int, float, bool, complex, str, bytes, type(None))
_AGREE = 1e-6  # relative difference in float64 below which a backward is the derivative
_TORCH_OWN = frozenset(nn.Module().__dict__)  # a module's hooks and children


def _contents(container: Any) -> Any:
    """What a list, dict or set holds, by identity (compared after the forward)."""
    if isinstance(container, dict):
        return tuple((k, id(v)) for k, v in container.items())
    if isinstance(container, set):
        return frozenset(map(id, container))
    return tuple(map(id, container))


class TraceWatch:
    """A context around ``torch.export.export(model, ...)``; :meth:`check` after it."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._names = {id(m): name or "the model" for name, m in model.named_modules()}
        self.rebound: list[str] = []
        #: per custom Function class seen, the arguments of its first call (fake tensors)
        self.functions: dict[type, tuple[Any, ...]] = {}
        self._looked: dict[int, list[dict[str, Any]]] = {}
        self._handles: list[Any] = []
        self._wrapped: list[tuple[type, Any]] = []

    def __enter__(self) -> TraceWatch:
        for module in self._model.modules():
            self._handles.append(module.register_forward_pre_hook(self._before))
            self._handles.append(module.register_forward_hook(self._after))
        self._wrap_functions()
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        for cls, own in self._wrapped:
            cls.forward = own  # type: ignore[attr-defined]
        self._handles, self._wrapped = [], []

    def check(self) -> None:
        """Raises what the trace dropped.

        Raises:
            ModelError: a forward rebinds state, or applies a custom autograd.Function
                whose backward is not autograd's derivative of its forward.
        """
        name = type(self._model).__name__
        for cls, args in self.functions.items():
            problem = _backward_differs(cls, args)
            if problem:
                raise ModelError(
                    f"{name}'s forward applies the autograd.Function {cls.__qualname__}, "
                    f"whose backward {problem}: torch.export traces a Function's forward "
                    "and drops its backward, so a traced pipeline would compute autograd's "
                    "gradient of the forward instead (a straight-through estimator's would "
                    "be zero). Cut an nn.Sequential with balance= (run as it is, not "
                    "traced), or make it a torch.library.custom_op with register_autograd, "
                    "which torch.export keeps whole")
        if self.rebound:
            raise ModelError(
                f"{name}'s forward rebinds {', '.join(self.rebound)}; torch.export records "
                "no such change, so the traced stages would read the value it had when "
                "traced, never updated (the plain model updates it at every call). Update a "
                "buffer in place (self.count.add_(1), self.average.copy_(...)), keep Python "
                "counters and containers out of forward, or cut an nn.Sequential with "
                "balance= (run as it is, not traced); a change that does not matter (a log) "
                "can be declared harmless: conveyor_harmless = ('name',) on the module")

    # ------------------------------------------------------------------ rebinding

    @staticmethod
    def _state(module: nn.Module) -> dict[str, Any]:
        harmless = set(getattr(module, "conveyor_harmless", ()))
        held = {k: v for k, v in module.__dict__.items()
                if isinstance(v, (torch.Tensor, *_PLAIN)) and not k.startswith("__")}
        contents = {f"contents {k}": _contents(v) for k, v in module.__dict__.items()
                    if isinstance(v, (list, dict, set)) and k not in _TORCH_OWN}
        state = {**held, **contents, **{f"buffer {k}": v for k, v in module._buffers.items()}}
        return {k: v for k, v in state.items() if k.split()[-1] not in harmless}

    def _before(self, module: nn.Module, args: Any) -> None:
        self._looked.setdefault(id(module), []).append(self._state(module))

    def _after(self, module: nn.Module, args: Any, output: Any) -> None:
        old, new = self._looked[id(module)].pop(), self._state(module)
        for key in dict.fromkeys([*old, *new]):  # in the module's order
            a, b = old.get(key), new.get(key)
            if a is b or (isinstance(a, (*_PLAIN, tuple, frozenset)) and type(a) is type(b)
                          and a == b):
                continue
            where = f"{self._names.get(id(module), type(module).__name__)}.{key.split()[-1]}"
            where += " (a container changed in place)" if key.startswith("contents ") else ""
            if where not in self.rebound:
                self.rebound.append(where)

    # ------------------------------------------------------------------ functions

    def _wrap_functions(self) -> None:
        """Wraps the ``forward`` of each autograd.Function class not of torch's own:
        autograd looks it up on the class at each call, however ``apply`` was reached
        (``F.apply(x)``, or a bound ``apply`` kept since before the trace)."""
        tracer = threading.get_ident()

        def watching(cls: type, forward: Any) -> Any:
            def watched(*args: Any, **kwargs: Any) -> Any:
                if threading.get_ident() == tracer and cls not in self.functions:
                    ctx_first = "setup_context" not in vars(cls)  # forward(ctx, *args)
                    self.functions[cls] = args[1:] if ctx_first else args
                return forward(*args, **kwargs)
            return staticmethod(watched)

        for cls in _subclasses(torch.autograd.Function):
            own = cls.__dict__.get("forward")
            if own is not None and not cls.__module__.startswith("torch."):
                self._wrapped.append((cls, own))
                cls.forward = watching(cls, cls.forward)  # type: ignore[attr-defined]


def _subclasses(cls: type) -> list[type]:
    found: list[type] = []
    todo = [cls]
    while todo:
        subclasses: list[type] = todo.pop().__subclasses__()
        found += subclasses
        todo += subclasses
    return found


class _Context:
    """What a Function's ``forward(ctx, ...)`` may call on its context, doing nothing:
    the forward then runs as plain operations that autograd differentiates."""

    needs_input_grad: tuple[bool, ...] = ()
    saved_tensors: tuple[torch.Tensor, ...] = ()

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


def _backward_differs(cls: type, traced: tuple[Any, ...]) -> str:
    """How ``cls``'s backward differs from autograd's gradient of its forward on random
    float64 inputs shaped as ``traced`` (its arguments in the trace); "" if it agrees."""
    generator = torch.Generator().manual_seed(0)

    def real(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        shape = [int(size) for size in value.shape]
        if value.is_floating_point():
            return torch.randn(shape, dtype=torch.float64, generator=generator
                               ).requires_grad_(value.requires_grad)
        return torch.zeros(shape, dtype=value.dtype)

    try:
        args = pytree.tree_map(real, traced)
        wanted = [a for a in pytree.tree_leaves(args)
                  if isinstance(a, torch.Tensor) and a.requires_grad]
        if not wanted:
            return ""
        own = cls.apply(*args)  # type: ignore[attr-defined]
        plain = cls.forward(*([] if "setup_context" in vars(cls) else [_Context()]), *args)  # type: ignore[attr-defined]
        outputs = [t for t in pytree.tree_leaves(own)
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        cotangents = [torch.randn(t.shape, dtype=t.dtype, generator=generator) for t in outputs]
        given = torch.autograd.grad(outputs, wanted, cotangents, allow_unused=True)
        derived_outputs = [t for t in pytree.tree_leaves(plain) if isinstance(t, torch.Tensor)
                           and t.requires_grad]
        if len(derived_outputs) != len(outputs):
            return "cannot be compared with its forward's derivative (its outputs differ)"
        derived = torch.autograd.grad(derived_outputs, wanted, cotangents, allow_unused=True)
    except Exception as exc:  # noqa: BLE001 - any failure: the Function cannot be checked
        return f"could not be compared with its forward's derivative ({type(exc).__name__}: {exc})"
    for a, b in zip(given, derived):
        a = torch.zeros_like(wanted[0]) if a is None else a
        b = torch.zeros_like(a) if b is None else b
        scale = max(float(a.abs().max()), float(b.abs().max()), 1e-30)
        if float((a - b).abs().max()) > _AGREE * scale:
            return (f"is not its forward's derivative (they differ by "
                    f"{float((a - b).abs().max()) / scale:.2g} relative)")
    return ""
