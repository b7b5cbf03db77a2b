"""Drawing a few cases that cover the most: what the generators' CI samples use."""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable, Sequence
from collections.abc import Set as AbstractSet
from typing import TypeVar

C = TypeVar("C")


def most_varied(cases: Sequence[C], count: int, seed: int,
                traits: Callable[[C], AbstractSet[Hashable]]) -> list[C]:
    """``count`` of ``cases``, shuffled by ``seed``, each next one the case that adds
    the most ``traits`` not yet drawn (greedy cover)."""
    left = list(cases)
    random.Random(seed).shuffle(left)
    chosen: list[C] = []
    seen: set[Hashable] = set()
    for _ in range(min(count, len(left))):
        best = max(left, key=lambda c: len(traits(c) - seen))
        chosen.append(best)
        left.remove(best)
        seen |= traits(best)
    return chosen
