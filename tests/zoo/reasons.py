"""Why a run of the zoo failed, in a few words: the known causes, found by reading the
failures (each a pattern of the error's first line and what it means)."""

from __future__ import annotations

import re

from tests.zoo.harness import Outcome

__all__ = ["REASONS", "reason_of"]

REASONS = [
    (r"(DynamicCache|EncoderDecoderCache).*not a known type",
     "use_cache=True returns a cache object torch.export cannot flatten (conveyor: pass "
     "use_cache=False, or the default-kwargs change)"),
    (r"has no repeated blocks",
     "one layer shared across the depth (ALBERT): no list of blocks for stages=2 to cut; "
     "give split_at"),
]


def reason_of(family: str, outcome: Outcome) -> str:
    """The reason of ``outcome``'s failure, or ``""`` for a run that did not fail."""
    if outcome.failure is None:
        return ""
    for pattern, reason in REASONS:
        if re.search(pattern, outcome.failure):
            return reason
    return f"unexplained failure of {family}: see the report"
