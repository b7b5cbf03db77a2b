"""Which modules a stage splits, and how: a plan of module-name patterns and styles.

``tp_plan="auto"`` reads a Hugging Face model's own plan (the model's ``_tp_plan``, else
its ``config.base_model_tp_plan`` under the base model's prefix); a dict maps patterns
of the model's own qualified names (``"model.layers.*.mlp.up_proj"``, ``*`` one name) to
a style name or a torch ``ParallelStyle``. Every style a plan names is one conveyor
implements exactly (:data:`STYLES`) or one it refuses by name (:data:`REFUSED`, and any
name it does not know): never dropped.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from torch import nn

from conveyor.errors import TensorParallelError

__all__: list[str] = []

#: The styles conveyor implements, and what each does to an ``nn.Linear`` (or
#: ``nn.Embedding``) of a stage.
STYLES = {
    "colwise": "output features split; the input's gradient summed over the group",
    "rowwise": "input features split; the output summed over the group (bias added once)",
    "colwise_gather_output": "colwise, its output gathered whole on every rank",
    "embedding_rowwise": "vocabulary split; each rank looks up its rows, summed",
    "replicated_with_grad_allreduce": "kept whole; its gradient summed over the group",
    "replicated": "kept whole (every rank sees the whole of its input)",
}
#: Styles of Hugging Face plans conveyor refuses, and why.
REFUSED = {
    "packed_colwise": "a fused gate/up weight split per half (Mixtral's experts)",
    "moe_tp_experts": "experts split over the group (expert parallelism)",
    "sequence_parallel": "activations split along the sequence",
    "local_colwise": "a split the model's code reduces itself",
    "local_rowwise": "a split the model's code reduces itself",
    "local": "a split the model's code reduces itself",
    "gather": "an output gathered without a split weight",
    "local_packed_rowwise": "a fused weight split per part",
    "ep_router": "expert parallelism's router",
    "grouped_gemm": "experts as one grouped matrix product",
    "isolated": "a module kept apart from the group",
    "mla_kv_a_proj": "multi-head latent attention's shared projection",
}


def style_of(value: Any, pattern: str) -> str:
    """The style name of a plan's value: a name, or a torch ``ParallelStyle`` that maps
    to one (ColwiseParallel, RowwiseParallel with their default layouts; ColwiseParallel
    with ``output_layouts=Replicate()``: colwise_gather_output).

    Raises:
        TensorParallelError: neither a known name nor a ParallelStyle conveyor maps.
    """
    if isinstance(value, str):
        return value
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    kind = type(value).__name__
    outputs = getattr(value, "output_layouts", None)
    if type(value) is ColwiseParallel:
        if outputs == Shard(-1) or outputs == (Shard(-1),):
            return "colwise"
        if outputs == Replicate() or outputs == (Replicate(),):
            return "colwise_gather_output"
    if type(value) is RowwiseParallel and outputs in (Replicate(), (Replicate(),)):
        return "rowwise"
    raise TensorParallelError(
        f"tp_plan[{pattern!r}] = {kind}(...) with output_layouts={outputs}: conveyor maps "
        "ColwiseParallel() (colwise), ColwiseParallel(output_layouts=Replicate()) and "
        "RowwiseParallel() with their default layouts; give a style name of "
        f"{sorted(STYLES)} instead")


def plan_shown(tp_plan: Any) -> Any:
    """A plan as plain data, to compare across ranks (a ParallelStyle by its class)."""
    if isinstance(tp_plan, Mapping):
        return {str(k): v if isinstance(v, str) else type(v).__name__
                for k, v in tp_plan.items()}
    return tp_plan


def resolve_plan(model: nn.Module, tp_plan: str | Mapping[str, Any] | None) -> dict[str, str]:
    """The plan as {pattern: style name}, every style known (not yet checked against
    the modules it names).

    Raises:
        TensorParallelError: "auto" for a model without a plan of its own (naming its
            modules that no style fits), an unknown or refused style, or no plan at all.
    """
    if tp_plan is None:
        raise TensorParallelError("tensor_parallel > 1 needs tp_plan=: \"auto\" (the "
                                  "model's own, Hugging Face) or {pattern: style}")
    if isinstance(tp_plan, str):
        if tp_plan != "auto":
            raise TensorParallelError(f"tp_plan={tp_plan!r}: give \"auto\" or a dict")
        raw = _own_plan(model)
    else:
        raw = dict(tp_plan)
    plan = {pattern: style_of(value, pattern) for pattern, value in raw.items()}
    for pattern, style in plan.items():
        if style in REFUSED:
            raise TensorParallelError(
                f"tp_plan[{pattern!r}] = {style!r} ({REFUSED[style]}) is not supported by "
                f"conveyor's tensor parallelism; map those modules to a style of "
                f"{sorted(STYLES)} (\"replicated\" keeps them whole), or leave tensor_parallel=1")
        if style not in STYLES:
            raise TensorParallelError(
                f"tp_plan[{pattern!r}] = {style!r} is not a style conveyor knows; give one "
                f"of {sorted(STYLES)} or a torch ColwiseParallel/RowwiseParallel")
    return plan


def _own_plan(model: nn.Module) -> dict[str, Any]:
    """A Hugging Face model's own plan, by the model's qualified names."""
    own = dict(getattr(model, "_tp_plan", None) or {})
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    if base and prefix and hasattr(model, prefix):
        base = {f"{prefix}.{pattern}": style for pattern, style in base.items()}
    plan = {**base, **own}
    if not plan:
        unfit = [name for name, module in model.named_modules()
                 if type(module).__name__ == "Conv1D"][:3]
        said = f" (its {', '.join(unfit)} are Conv1D, which no style splits)" if unfit else ""
        raise TensorParallelError(
            f"tp_plan=\"auto\": {type(model).__name__} carries no tensor-parallel plan "
            f"(no _tp_plan, no config.base_model_tp_plan){said}; give tp_plan={{pattern: "
            "style}} for its nn.Linear modules, or leave tensor_parallel=1")
    return plan


def with_split_head(model: nn.Module, plan: Mapping[str, str], head: str) -> dict[str, str]:
    """``plan`` with the module ``head`` split column-wise and its output left split
    (``"colwise"``, first: it decides), for a cross-entropy over the group's parts of
    the vocabulary; a pattern that named the head alone is dropped."""
    names = [name for name, _ in model.named_modules() if name != head]
    kept = {pattern: style for pattern, style in plan.items()
            if not matcher(pattern).fullmatch(head)
            or any(matcher(pattern).fullmatch(name) for name in names)}
    return {head: "colwise", **kept}


def matcher(pattern: str) -> re.Pattern[str]:
    """A plan pattern as a regular expression over qualified names (``*``: one name)."""
    return re.compile(r"[^.]+".join(re.escape(part) for part in pattern.split("*")))


def planned_modules(model: nn.Module, plan: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """{qualified name: (style, pattern)} of the modules the plan names, the first
    pattern in the plan's order deciding.

    Raises:
        TensorParallelError: a pattern names no module of the model.
    """
    compiled = [(pattern, matcher(pattern), style) for pattern, style in plan.items()]
    found: dict[str, tuple[str, str]] = {}
    used: set[str] = set()
    for name, _ in model.named_modules():
        for pattern, regex, style in compiled:
            if regex.fullmatch(name):
                found[name] = (style, pattern)
                used.add(pattern)
                break
    unused = [p for p in plan if p not in used]
    if unused:
        raise TensorParallelError(
            f"tp_plan pattern(s) {unused} name no module of {type(model).__name__}; "
            "patterns use the model's own qualified names (model.named_modules()), "
            f"e.g. {[n for n, _ in model.named_modules() if n][:3]}")
    return found
