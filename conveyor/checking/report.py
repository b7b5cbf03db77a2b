"""What :func:`conveyor.check` found, as a report to print or read."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field

from conveyor.checking.compare import Finding
from conveyor.checking.floor import Floor

__all__ = ["CheckReport"]


@dataclass
class CheckReport:
    """What :func:`check` found: ``ok`` when everything matched.

    Attributes:
        setup: the pipeline that was checked, in words.
        compared: what was compared, in words.
        findings: the first difference of each kind, in the order a step runs.
        rtol: the relative tolerance the values were compared with: the one asked
            for, or the plain model's own noise floor times its margin where the model
            computes below float64 inside (see :mod:`conveyor.checking.floor`).
        floor: how far the plain model differs from itself, and why.
    """

    setup: str
    compared: str
    findings: list[Finding] = field(default_factory=list)
    rtol: float = 0.0
    floor: Floor = field(default_factory=Floor)

    @property
    def ok(self) -> bool:
        return not self.findings

    def __str__(self) -> str:
        lines = [f"conveyor check: {self.setup}", f"compared with the plain model on the "
                 f"whole batch (float64, rtol {self.rtol:g}): {self.compared}"]
        if self.floor.elevated:
            lines.append(_indent("the plain model's own noise floor: " + self.floor.cause()))
        if self.ok:
            return "\n".join([*lines, "MATCH: the pipeline computes what the plain model does"])
        first, *rest = self.findings
        lines += ["DIFFERS", f"first difference: {first}{_more(first)}",
                  _indent("likely cause: " + first.cause)]
        if rest:
            lines.append("then:")
        for finding in rest:
            said = finding.cause == first.cause
            lines += [f"  {finding}{_more(finding)}",
                      _indent("the same cause" if said else finding.cause, 4)]
        return "\n".join(lines)


_COUNTED = {"forward": "layers", "gradient": "gradients", "buffer": "buffers"}


def _more(finding: Finding) -> str:
    counted = _COUNTED.get(finding.kind)
    return f" ({finding.count} {counted} differ)" if counted and finding.count > 1 else ""


def _indent(text: str, by: int = 2) -> str:
    return textwrap.fill(text, 92, initial_indent=" " * by, subsequent_indent=" " * (by + 2))
