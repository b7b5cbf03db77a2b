"""The options of a :class:`~conveyor.Pipeline`, written once.

``Pipeline(module, loss_fn=..., chunks=..., ...)`` keeps the options it was given in one
frozen :class:`PipelineOptions` (``pipe.options``). What the ranks of a job must agree
on, and what the cut of the model takes, are read off the fields' marks here, never
written out again as string-keyed dicts; a test holds the pipeline's signature and its
docstring to these fields::

    PipelineOptions              agreed by every rank     handed to the cut
      chunks, schedule, ...      x (as plain data)
      balance, split_at          x                        x
      init_fn, weights                                    x
      loss_fn, devices, sample   (per rank, or not comparable)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from conveyor.distributed.faults.agreement import schedule_of
from conveyor.distributed.topology import Topology
from conveyor.engine.devices import Device
from conveyor.engine.loss import LossFn
from conveyor.engine.offload import check_offload
from conveyor.engine.recompute.replay import recompute_mode
from conveyor.engine.step import check_options
from conveyor.errors import ConveyorError
from conveyor.graph.weights import InitFn, Weights
from conveyor.runtime.rebalance.rebalancing import BalancePolicy
from conveyor.runtime.verify import check_every
from conveyor.schedules import Schedule
from conveyor.tensor.plan import plan_shown

__all__: list[str] = []

_AGREED, _CUT = "agreed", "cut"


def _option(default: Any = MISSING, *, agreed: Callable[[Any], Any] | bool = False,
            cut: bool = False) -> Any:
    """A field: ``agreed`` (True, or how to show the value to the other ranks) and
    ``cut`` mark what the ranks compare and what the cut takes."""
    shown = (lambda value: value) if agreed is True else agreed or None
    return field(default=default, metadata={_AGREED: shown, _CUT: cut})


def _planned(given: dict[str, Any]) -> dict[str, Any]:
    """The options ``given["plan"]`` sets, none of them given otherwise."""
    planned = given["plan"].pipeline_options()
    defaults = {f.name: f.default for f in fields(PipelineOptions)}
    for name, value in planned.items():
        if given[name] != defaults[name] and _listed(given[name]) != _listed(value):
            raise ConveyorError(f"plan= sets {name}={value!r}, but {name}={given[name]!r} "
                                "was given too; leave it to the plan, or plan again")
    return planned


def _listed(value: Any) -> Any:
    """A sequence (not a string) as a list, anything else as it is: how options are
    shown to the other ranks and compared with a plan's."""
    return list(value) if isinstance(value, Sequence) and not isinstance(value, str) \
        else value


@dataclass(frozen=True)
class PipelineOptions:
    """Every keyword option of :class:`~conveyor.Pipeline` (documented there)."""

    loss_fn: LossFn | None
    chunks: int = _option(None, agreed=True)
    stages: int | None = _option(None)
    layers: int | None = _option(None, agreed=True, cut=True)
    balance: Sequence[int] | str | None = _option(None, agreed=_listed, cut=True)
    split_at: Sequence[str] | None = _option(None, agreed=_listed, cut=True)
    sample: Any = _option(None)
    schedule: str | Schedule = _option("gpipe", agreed=schedule_of)
    virtual_stages: int = _option(1, agreed=True)
    devices: Sequence[Device] | None = _option(None)
    recompute: str | Sequence[str] | None = _option(None)
    checkpoint: str | Sequence[str] | None = _option(None)
    offload: str | Sequence[str | None] | None = _option(None, agreed=_listed)
    data_parallel: int | Sequence[int] = _option(1, agreed=_listed)
    sharding: str = _option("replicate", agreed=True)
    tensor_parallel: int = _option(1, agreed=True)
    tp_plan: str | Mapping[str, Any] | None = _option(None, agreed=lambda plan: plan_shown(plan))
    tie_weights: Sequence[Sequence[str]] = _option(
        (), agreed=lambda groups: [list(group) for group in groups], cut=True)
    check_finite: bool = _option(True, agreed=True)
    precision: str | None = _option(None, agreed=True)
    compile: bool = _option(False, agreed=True)
    cuda_graphs: bool = _option(False, agreed=True)
    timeout: float | None = _option(None)
    deferred_batch_norm: bool = _option(False, agreed=True, cut=True)
    init_fn: InitFn | None = _option(None, cut=True)
    weights: Weights | None = _option(None, cut=True)
    rebalance: BalancePolicy | None = _option(
        None, agreed=lambda policy: None if policy is None else repr(policy))
    topology: Topology | None = _option(None)
    verify_every: int | None = _option(None, agreed=True)
    plan: Any = _option(None)

    @classmethod
    def of(cls, given: dict[str, Any]) -> PipelineOptions:
        """The options among ``given`` (a constructor's ``locals()``), checked, with
        what ``plan=`` sets in place.

        Raises:
            ConveyorError: an option disagrees with the plan, or no ``chunks``.
            MicroBatchError: ``chunks`` is not a positive integer.
            ValueError: not a recompute mode, or both ``recompute`` and ``checkpoint``.
        """
        given = {f.name: given[f.name] for f in fields(cls)}
        if given["plan"] is not None:
            given.update(_planned(given))
        if given["chunks"] is None:
            raise ConveyorError("give chunks= (the number of micro-batches per step) or "
                                "plan= (a conveyor.planner.PipelinePlan)")
        options = cls(**given)
        check_options(chunks=options.chunks, recompute=options.recompute,
                      checkpoint=options.checkpoint)
        check_offload(options.offload)
        check_every(options.verify_every)
        return options

    @property
    def mode(self) -> str | tuple[str, ...]:
        """The recompute mode (``recompute=``, or its alias ``checkpoint=``).

        Raises:
            ValueError: both are given, or an unknown mode.
        """
        return recompute_mode(self.recompute, self.checkpoint)

    def agreed(self) -> dict[str, Any]:
        """What every rank must have been given alike, as plain data (the recompute
        mode as resolved)."""
        shown = {f.name: f.metadata[_AGREED](getattr(self, f.name)) for f in fields(self)
                 if f.metadata.get(_AGREED)}
        return {**shown, "recompute": self.mode}

    def cut(self) -> dict[str, Any]:
        """The options the cut of the model takes, by name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.metadata.get(_CUT)}
