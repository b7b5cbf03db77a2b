"""Why a pipeline differs from the plain model: the likely cause of a difference that
:func:`conveyor.check` found, read from what it could see, and what to do about it.

Each function returns one paragraph for a person: what the layer does, why that
breaks the pipeline's equivalence with the plain model, and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch.fx as fx

from conveyor.checking.probe import Probe
from conveyor.torchprivate import pytree

__all__: list[str] = []


def _names(modules: Sequence[str]) -> str:
    shown = [repr(m) for m in modules[:3]]
    return ", ".join(shown) + (f" and {len(modules) - 3} more" if len(modules) > 3 else "")


def of_layer(where: str, probe: Probe | None, *, mutated_stage_input: int | None,
             recomputation: bool) -> str:
    """The likely cause of a layer whose output differs: from the plain model's (a
    forward), or from its own first forward (a recomputation).

    Args:
        where: the layer, as the report names it.
        probe: what probing the layer (or the whole traced model) found.
        mutated_stage_input: the stage whose input the layer changed in place, if any.
        recomputation: the difference is between the forward and its recomputation.
    """
    if mutated_stage_input is not None:
        return in_place(where, mutated_stage_input)
    if probe is not None and probe.where("own_generator"):
        return own_generator(probe.where("own_generator"))
    if probe is not None and (not probe.repeatable or probe.where("changed")):
        return state(where, probe)
    if probe is not None and probe.where("batch_norm") and not recomputation:
        return batch_norm(probe.where("batch_norm"))
    if recomputation:
        return (f"{where} gave another result when recomputed for backward from the same "
                "input: it reads something that changed between the two calls (a global, "
                "the time, a random generator conveyor does not see, such as numpy's or "
                "Python's `random`); compute forward from its inputs and parameters alone, "
                "or use recompute='never'")
    return (f"{where} computes differently on a micro-batch on a stage's thread than on "
            "the whole batch: it mixes the samples of its batch (a statistic over the batch, "
            "as batch norm takes), or reads state that differs on the stage's thread "
            "(torch.is_grad_enabled(), the number of threads, a global); make each "
            "sample's output depend on that sample and the parameters alone")


def shared_across_stages(shared: Sequence[Any]) -> str:
    """The cause where layers of two stages hold one object (``Shared``, from
    ``conveyor.engine.recompute.firstlook``)."""
    return (f"state shared across stages: {'; '.join(s.describe() for s in shared[:3])}. "
            "Each rank holds its own copy of it, so what one stage writes another does not "
            "see as the plain model's order would (Pipeline refuses it when a forward writes "
            "it); put its holders in one stage (balance=), or give each its own object")


def batch_norm(modules: Sequence[str]) -> str:
    return (f"batch norm in training mode ({_names(modules)}): in the pipeline it "
            "normalises each micro-batch by that micro-batch's mean and variance (as GPipe "
            "does), the plain model by the whole batch's. Expected with chunks > 1; to match, "
            "normalise within each sample (nn.LayerNorm, nn.GroupNorm) or train with "
            "chunks=1; deferred_batch_norm=True makes the running statistics, which eval "
            "mode uses, equal the plain model's")


def own_generator(modules: Sequence[str]) -> str:
    return (f"random numbers drawn from a torch.Generator of its own (generator=...) in "
            f"{_names(modules)}: conveyor replays its state when recomputing, but its draws "
            "follow the order in which the stage runs micro-batches, which a schedule may "
            "change. Draw from torch's default generator (leave out generator=): conveyor "
            "gives each layer and micro-batch a stream of its own")


def state(where: str, probe: Probe) -> str:
    changed = [f"{name}.{change}" for name in probe.where("changed")
               for change in probe.modules[name].changed]
    culprit = probe.unrepeatable or (probe.where("changed") or [where])[0]
    attributes = f" (two calls changed {'; '.join(changed[:3])})" if changed else ""
    kind = ("a buffer mutated in forward" if any("(buffer)" in c for c in changed)
            else "state outside its inputs and parameters")
    return (f"{culprit!r} gives different outputs for the same input on two calls, "
            f"without drawing random numbers from torch{attributes}: it reads {kind}. "
            "The pipeline calls it once per micro-batch (a recomputation sees the state "
            "as the first call saw it), the plain model once per batch, and a traced model "
            "keeps the value seen when it was traced. Compute forward from its inputs and "
            "parameters alone (keep counters and clocks out of forward), or compare with "
            "the plain model run micro-batch by micro-batch, as the pipeline runs it")


def in_place(where: str, stage: int) -> str:
    more = ("; on stage 0 that input is your batch, changed under you" if stage == 0 else
            "; torch refuses most such changes there, as the input is a leaf that "
            "requires grad")
    return (f"{where} changes its input in place, and it is the first layer of stage "
            f"{stage}: the stage keeps that input to recompute its layers in backward, so "
            f"the recomputation starts from the changed values{more}. Make the change out "
            "of place (x = x * 2, not x.mul_(2))")


def hidden_tie(reader: str, stage: int, parameter: str, owner: str, path: str | None) -> str:
    how = f"through {path}" if path else "by a path the pipeline cannot see"
    return (f"{reader} on stage {stage} uses {parameter!r} (a parameter of {owner}) {how}, "
            f"not as a parameter of its own: the pipeline finds no tie, and in a torchrun "
            f"job stage {stage}'s "
            "process holds a copy of its own, whose gradient is lost and whose value drifts "
            "apart. Share the nn.Parameter itself (head.weight = embedding.weight), or name "
            "both uses in tie_weights=")


def split_input(where: str, source: str) -> str:
    return (f"{where} takes {source}, which the plan splits over the tensor group and "
            "does not gather, so each tensor rank computes it on its own part of the "
            "features: an operation that mixes them (a softmax, a norm, a mean over the "
            "last dimension) sees only that part. Split only layers whose partner comes "
            "straight after (colwise, then the rowwise layer that sums it), or gather the "
            "output whole ('colwise_gather_output')")


def tensor_ranks_disagree(parameter: str, stage: int) -> str:
    return (f"the tensor ranks of stage {stage} hold different gradients of {parameter!r}, "
            "which the plan leaves whole on each of them: each rank's part of the layer "
            "uses it on only that rank's part (a per-head norm after split attention), so "
            "each sees only its share of the gradient. Sum it over the tensor group: the "
            "'replicated_with_grad_allreduce' style in tp_plan")


def undeclared_tie(names: Sequence[str]) -> str:
    return (f"{_names(names)} are one nn.Parameter in the model your layer function "
            "builds, but a pipeline builds each rank's layers apart, so they become "
            f"separate weights; pass tie_weights=[{tuple(names)!r}]")


def loss_average(whole: float, weighted: float) -> str:
    return (f"every layer's output matches, but loss_fn on the whole batch ({whole:.10g}) "
            f"is not the share-weighted mean of its values on the micro-batches "
            f"({weighted:.10g}): it does not average over samples. A loss averaged over a "
            "count that differs between micro-batches (tokens that are not padding, "
            "ignore_index) does this; return (loss_sum, count) from loss_fn, and the "
            "pipeline divides the sum by the whole batch's count")


def random_with_batch_norm(where: str, modules: Sequence[str]) -> str:
    return (f"{where} draws random numbers, so the check runs it micro-batch by "
            "micro-batch as the pipeline draws, and it cannot be compared with the whole "
            "batch; " + batch_norm(modules))


def follows(kind: str) -> str:
    return f"follows from the {kind} difference above"


@dataclass(frozen=True)
class Program:
    """What a traced stage's program makes and returns, small enough to travel
    between ranks.

    Attributes:
        made: the names of the values it computes.
        returned: the model's output leaves it returns as they came to it from an
            earlier stage, each as (its path in the output, the value's name).
    """

    made: frozenset[str]
    returned: tuple[tuple[str, str], ...]


def programs_of(stages: Mapping[int, Any]) -> dict[int, Program]:
    """Each traced stage's :class:`Program` (in training mode as the stage is), by stage;
    none for stages that are not traced."""
    found = {}
    for k, stage in stages.items():
        program = getattr(stage.layers[0], "programs", {}).get(stage.layers[0].training)
        if program is None:
            continue
        received = set(program.receives)
        names = [v.name if isinstance(v, fx.Node) and v.name in received else None
                 for v in program.user_outputs]
        returned = tuple(
            (pytree.keystr(path), name) for path, name in pytree.tree_flatten_with_path(
                pytree.tree_unflatten(names, program.out_spec))[0] if name is not None)
        found[k] = Program(frozenset(program.made), returned)
    return found


def returned_early(programs: Mapping[int, Program]) -> list[tuple[str, int]]:
    """The leaves of a traced model's output that a stage before the last makes and the
    last stage returns as they came to it (an encoder's state returned beside the
    logits), each as (its path in the output, the stage that makes it).

    Args:
        programs: every traced stage's program, by stage (:func:`programs_of`).
    """
    if not programs:  # not a traced model
        return []
    found = []
    for path, name in programs[max(programs)].returned:
        maker = next((k for k, program in sorted(programs.items()) if name in program.made),
                     None)
        if maker is not None:
            found.append((path, maker))
    return found


def counted_twice(early: Sequence[tuple[str, int]], ratio: float) -> str:
    """A gradient of a value the model returns from an earlier stage, counted twice
    (or lost) by a split backward of a recomputed last stage."""
    path, stage = early[0]
    more = "".join(f", stage {k}'s {p}" for p, k in early[1:])
    what = "counted twice" if ratio > 1 else "lost"
    return (f"stage {stage}'s output {path}{more} reaches the model's output directly and "
            f"its gradient was {what} under split backward with recomputation (the "
            f"gradients upstream of it are {ratio:.3g}x the plain model's): the last "
            "stage's input-gradient pass I started from the loss's total gradient of that "
            "output, which already holds what flows into it through the last stage, and "
            "the rebuilt graph adds that again. Run with recompute='never' or "
            "schedule='1f1b', or return only the values the loss reads (leave "
            f"{path} out of the model's output)")
