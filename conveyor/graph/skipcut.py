"""Skip connections and the cut: every stash matched with its pop, and where a skip
crosses a stage boundary (then the layers are traced and cut as ``split_at=`` does).

:func:`verify_skips` checks an ``nn.Sequential``'s skips before a pipeline is built: in
the order the layers run, every pop takes a value an earlier layer stashed and that is
not popped yet, every stash is popped, and a name is not stashed again while its value
waits (:mod:`conveyor.graph.skip` says how layers declare and use them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from conveyor.errors import BalanceError, ModelError, SkipError
from conveyor.graph.skip import Key, declared_of, describe, skip_key
from conveyor.graph.source import sequential_layers

__all__: list[str] = []


@dataclass(frozen=True)
class Skip:
    """One matched stash and pop: the skip's key, and the layers (index in the
    ``nn.Sequential``, and the path of the submodule) that stash and pop it."""

    key: Key
    stashed_by: int
    popped_by: int
    stash_path: str
    pop_path: str


def verify_skips(model: nn.Module) -> None:
    """Checks that the stashes and pops of an ``nn.Sequential``'s layers match: each pop
    takes a value an earlier layer stashed and nothing popped yet, each stash is
    popped, and no name is stashed again while its value waits. ``GPipe`` and
    ``Pipeline`` check this before they build anything.

    Raises:
        SkipError: the layers that do not match, each with what to do.
        TypeError: ``model`` is not an ``nn.Sequential``.
    """
    skips_of(sequential_layers(model))


def skips_of(layers: Sequence[tuple[str, nn.Module]]) -> list[Skip]:
    """The skips of ``layers`` in the order they are popped (see :func:`verify_skips`).

    Raises:
        SkipError: every mismatch, in one message.
    """
    waiting: dict[Key, tuple[int, str]] = {}
    popped: dict[Key, str] = {}
    skips: list[Skip] = []
    problems = []
    for index, (name, layer) in enumerate(layers):
        for path, module in layer.named_modules(prefix=name, remove_duplicate=False):
            declared = declared_of(module)
            if declared is None:
                continue
            for skip in sorted(declared.pop):
                key = skip_key(module, skip)
                if key in waiting:
                    stashed_by, stash_path = waiting.pop(key)
                    skips.append(Skip(key, stashed_by, index, stash_path, path))
                    popped[key] = path
                elif key in popped:
                    problems.append(
                        f"layer {path!r} pops {describe(key)}, which layer {popped[key]!r} "
                        "popped already; a value is popped once: stash it again in between, "
                        "or pop it once and stash what both need")
                else:
                    problems.append(
                        f"layer {path!r} pops {describe(key)}, but no layer before it stashes "
                        "it; stash it in an earlier layer (if one does, give both the same "
                        "namespace: conveyor.skip.isolate(layer, namespace))")
            for skip in sorted(declared.stash):
                key = skip_key(module, skip)
                if key in waiting:
                    problems.append(
                        f"layer {path!r} stashes {describe(key)} while the value layer "
                        f"{waiting[key][1]!r} stashed is not popped yet; give each pair a "
                        "namespace of its own: conveyor.skip.isolate(layer, namespace)")
                else:
                    waiting[key] = (index, path)
    problems += [f"layer {path!r} stashes {describe(key)}, but no later layer pops it; pop "
                 "it, or take it out of stash=" for key, (_, path) in waiting.items()]
    if problems:
        raise SkipError("the stashes and pops of the nn.Sequential do not match:\n" +
                        "\n".join(f"* {problem}" for problem in problems))
    return skips


def split_at_skips(layers: Sequence[tuple[str, nn.Module]], balance: Sequence[int], *,
                   sample: Any, deferred_batch_norm: bool) -> list[str] | None:
    """Where to cut the traced ``nn.Sequential`` when a skip crosses stages (the names
    of each stage's first layer but the first), or None when none crosses: every pop
    runs on its stash's stage, and the layers run as they are.

    Raises:
        SkipError: the stashes and pops do not match.
        BalanceError: a skip crosses stages but ``sample`` is missing, or
            ``deferred_batch_norm`` is asked for.
        ModelError: ``sample`` is a tuple or dict (a traced model's arguments, not one
            layer input).
    """
    skips = skips_of(layers)
    stage_of = [k for k, count in enumerate(balance) for _ in range(count)]
    crossing = [s for s in skips if stage_of[s.stashed_by] != stage_of[s.popped_by]]
    if not crossing:
        return None
    skip = crossing[0]
    where = (f"layer {skip.stash_path!r} stashes {describe(skip.key)} on stage "
             f"{stage_of[skip.stashed_by]} and layer {skip.pop_path!r} pops it on stage "
             f"{stage_of[skip.popped_by]}")
    if sample is None:
        raise BalanceError(f"{where}: conveyor traces the layers to send it; pass "
                           "sample=<one micro-batch as the model takes it>")
    if isinstance(sample, (tuple, dict)):  # a traced model takes these as its arguments
        raise ModelError(f"{where}, so the layers are traced, and a traced nn.Sequential "
                         "takes one argument: give each micro-batch as a tensor or a list "
                         f"of tensors, not a {type(sample).__name__}")
    if deferred_batch_norm:
        raise BalanceError(f"{where}, so the layers are traced, and a traced model's batch "
                           "norms update per micro-batch: drop deferred_batch_norm=True, or "
                           "choose a balance that keeps each stash and pop on one stage")
    starts = [sum(balance[:k]) for k in range(1, len(balance))]
    return [layers[start][0] for start in starts]
