"""A micro-batch as a call of the model's forward: the same call at trace and at run time.

A micro-batch is a tensor (the one positional argument), a tuple (positional arguments)
or a dict (keyword arguments). :class:`CallForm` binds it to ``forward``'s signature and
passes every argument that has a name by that name, in the signature's order, so that a
dict's key order, or a tensor given by position rather than by name, traces and runs
as one call; the first stage's inputs may be any of forward's arguments. Arguments that
conveyor adds (``use_cache=False``, where forward has that argument and the sample does
not give it: a cache object in the traced output would be of no use to a pipeline, and
torch.export cannot return it) are added to every micro-batch alike::

    forward(self, input_ids, attention_mask=None, use_cache=None, **kwargs)
    {"attention_mask": m, "input_ids": i}  ->  (), {"input_ids": i, "attention_mask": m,
                                                    "use_cache": False}
"""

from __future__ import annotations

import inspect
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from conveyor.errors import ModelError
from conveyor.torchprivate import pytree

__all__: list[str] = []

logger = logging.getLogger("conveyor")

_told: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # models told of use_cache=False
_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def as_call(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A micro-batch as the model's arguments: a tuple is positional, a dict keywords,
    anything else the one positional argument."""
    if isinstance(batch, tuple):
        return batch, {}
    if isinstance(batch, dict):
        return (), dict(batch)
    return (batch,), {}


@dataclass
class CallForm:
    """How every micro-batch calls the traced model: bound to ``forward``'s signature,
    named arguments by name, and the arguments conveyor adds.

    Attributes:
        model: the model's class name, for messages.
        signature: ``forward``'s signature (None: it has none Python can read; the
            micro-batch is passed as it is).
        added: arguments conveyor passes that the sample did not give.
        names: the arguments the sample gave, by name (set by :func:`call_form`).
    """

    model: str
    signature: inspect.Signature | None
    added: dict[str, Any] = field(default_factory=dict)
    names: tuple[str, ...] = ()

    def call(self, batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``batch`` as ``(args, kwargs)`` for forward.

        Raises:
            ModelError: ``batch`` does not fit forward's signature, or passes inputs
                through ``**kwargs``.
        """
        args, kwargs = as_call(batch)
        if self.signature is None:
            return args, kwargs
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise ModelError(f"the micro-batch does not fit {self.model}.forward{self.signature}"
                             f": {exc}; give a tensor, a tuple of positional arguments or a "
                             "dict of keyword arguments named as forward names them") from None
        kinds = {name: p.kind for name, p in self.signature.parameters.items()}
        if any(kinds[n] == inspect.Parameter.VAR_POSITIONAL and v for n, v in
               bound.arguments.items()):
            return args, {**kwargs, **self.added}  # *args: keep the order given
        positional: list[Any] = []
        named: dict[str, Any] = {}
        for name, value in bound.arguments.items():
            if kinds[name] == inspect.Parameter.VAR_KEYWORD:
                raise _through_var_keyword(self.model, name, value)
            if kinds[name] in _NAMED:
                named[name] = value
            elif kinds[name] == inspect.Parameter.POSITIONAL_ONLY:
                positional.append(value)
        named.update(self.added)
        order = list(self.signature.parameters)
        return tuple(positional), dict(sorted(named.items(), key=lambda i: order.index(i[0])))


def call_form(model: nn.Module, sample: Any) -> CallForm:
    """How ``model`` is called on ``sample`` and on every micro-batch after it; adds
    ``use_cache=False`` where forward takes ``use_cache`` and the sample leaves it out
    (said at INFO).

    Raises:
        ModelError: the sample does not fit forward (the message names the argument),
            or it passes inputs through ``**kwargs``.
    """
    name = type(model).__name__
    try:
        signature: inspect.Signature | None = inspect.signature(model.forward)
    except (TypeError, ValueError):
        signature = None
    form = CallForm(name, signature)
    if signature is None:
        return form
    args, kwargs = form.call(sample)
    given = {*signature.bind(*args, **kwargs).arguments}
    parameter = signature.parameters.get("use_cache")
    if parameter is not None and parameter.kind in _NAMED and "use_cache" not in given:
        form.added["use_cache"] = False
        if model not in _told:
            _told.add(model)
            logger.info("conveyor calls %s with use_cache=False: a pipeline returns no cache "
                        "of past keys and values (pass use_cache in the sample to decide)", name)
    form.names = tuple(sorted(given))
    return form


def _through_var_keyword(model: str, name: str, value: Any) -> ModelError:
    keys = sorted(value) if isinstance(value, dict) else value
    return ModelError(
        f"{model}.forward takes the sample's {keys} through **{name}, whose sizes "
        "torch.export cannot leave free (so no other batch size would run); give forward "
        "named parameters for them (def forward(self, input_ids, attention_mask=None)), "
        "or take them as def forward(self, *inputs) and give the sample as a tuple")


def widened(sample: Any) -> Any:
    """``sample`` with two rows where it has one: torch.export fixes a dimension of size
    1 to 1, and the pipeline's micro-batches may have other sizes. Every tensor with a
    batch dimension is concatenated with itself (they share dim 0, as micro-batches)."""
    leaves = [leaf for leaf in pytree.tree_leaves(sample)
              if isinstance(leaf, torch.Tensor) and leaf.dim() > 0]
    if not leaves or any(leaf.shape[0] != 1 for leaf in leaves):
        return sample
    return pytree.tree_map(
        lambda x: torch.cat([x, x]) if isinstance(x, torch.Tensor) and x.dim() > 0 else x,
        sample)
