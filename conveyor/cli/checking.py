"""``conveyor check --model package.module:function``: the divergence finder on the
command line.

The function takes no arguments and returns what to check, either as a tuple
``(model, inputs, targets)`` or ``(model, inputs, targets, loss_fn)``, or as a dict with
the keys ``model``, ``inputs``, ``targets`` and, if it likes, ``loss_fn`` and any keyword
of :func:`conveyor.check` (``split_at``, ``balance``, ``chunks``, ``tie_weights``, ...);
flags given on the command line win. Without a ``loss_fn``: integer targets get the
cross-entropy of the output's logits, summed over targets that are not -100 and
divided by their count (a ``(loss_sum, count)`` pair), floating targets the mean squared
error. Exit code 0 when the pipeline matches the plain model, 1 when it differs, 2 for
bad usage (one line on stderr).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from conveyor.train.user.code import load_function

if TYPE_CHECKING:
    _Commands = argparse._SubParsersAction[argparse.ArgumentParser]

__all__: list[str] = []

_IGNORE = -100  # the target of a position that counts for nothing (torch's ignore_index)


def add_parser(commands: _Commands, run: Callable[[argparse.Namespace], int]) -> None:
    """``conveyor check`` and its flags (torch-free, like every parser)."""
    sub = commands.add_parser(
        "check", help="run a pipelined step beside the plain model (float64, CPU threads) "
                      "and report where they differ, and why")
    sub.add_argument("--model", required=True, metavar="PACKAGE.MODULE:FUNCTION",
                     help="a function of no arguments returning (model, inputs, targets"
                          "[, loss_fn]) or a dict of conveyor.check's arguments")
    sub.add_argument("--stages", type=int, metavar="K",
                     help="pipeline ranks K to emulate; a model that is not an "
                          "nn.Sequential is cut among its blocks, as Pipeline cuts it")
    sub.add_argument("--balance", metavar="N,N,...|time",
                     help="layers per stage (nn.Sequential), or 'time' (balanced by time "
                          "on the sample)")
    sub.add_argument("--split-at", metavar="NAME,...",
                     help="submodules where stages 1, 2, ... begin (any nn.Module)")
    sub.add_argument("--sample", type=int, metavar="ROWS",
                     help="trace (or time) the model on the batch's first ROWS rows "
                          "(default: one micro-batch)")
    sub.add_argument("--schedule", metavar="NAME",
                     help="gpipe (default), 1f1b, interleaved-1f1b, zero-bubble, zb-v, "
                          "dualpipe-v, v-half or v-min")
    sub.add_argument("--chunks", type=int, metavar="M", help="micro-batches M (default 4)")
    sub.add_argument("--virtual-stages", type=int, metavar="V",
                     help="stages per rank, for interleaved-1f1b")
    sub.add_argument("--recompute", "--checkpoint", dest="recompute",
                     choices=["always", "except_last", "never"],
                     help="which micro-batches recompute in backward (default except_last)")
    sub.add_argument("--deferred-batch-norm", action="store_true", default=None,
                     help="batch-norm running statistics over the whole batch")
    sub.add_argument("--seed", type=int, metavar="N",
                     help="seed of the random streams (default 0)")
    sub.add_argument("--rtol", type=float, metavar="X",
                     help="relative tolerance (default 1e-7; a model that computes in float32 "
                          "inside is judged against 10x its own noise floor where that is "
                          "larger)")
    sub.add_argument("--tensor-parallel", type=int, metavar="T",
                     help="split each stage's planned modules over T tensor ranks; run "
                          "under torchrun with stages x T processes (rank 0 prints)")
    sub.add_argument("--tp-plan", metavar="auto|JSON",
                     help="with --tensor-parallel: auto (a Hugging Face model's own plan, "
                          "the default) or a JSON object {module pattern: style}")
    sub.add_argument("--json", action="store_true", help="print the report as JSON")
    sub.set_defaults(run=run)


def check_command(args: argparse.Namespace) -> int:
    """The body of ``conveyor check``."""
    from conveyor.errors import ConveyorError
    from conveyor.checking.check import check

    try:
        arguments = _arguments(args)
        report = check(**arguments)
    except (ConveyorError, TypeError) as exc:
        if _printing():
            print(f"conveyor check: error: {exc}", file=sys.stderr)
        return 2
    if not _printing():
        return 0 if report.ok else 1
    if args.json:
        print(json.dumps({"ok": report.ok, "setup": report.setup, "compared": report.compared,
                          "findings": [dataclasses.asdict(f) for f in report.findings]},
                         indent=2))
    else:
        print(report)
    return 0 if report.ok else 1


def _arguments(args: argparse.Namespace) -> dict[str, Any]:
    """conveyor.check's arguments: what the function returned, under the flags given.

    Raises:
        ConfigError: the function's result is not one of the forms the module's
            docstring lists, or a flag's value is malformed.
    """
    from torch import nn

    from conveyor.errors import ConfigError

    made = load_function(args.model, returning="what to check")()
    if isinstance(made, tuple) and len(made) in (3, 4):
        made = dict(zip(("model", "inputs", "targets", "loss_fn"), made))
    if not isinstance(made, dict) or not {"model", "inputs", "targets"} <= set(made):
        raise ConfigError(f"--model {args.model} returned {type(made).__name__}; return "
                          "(model, inputs, targets[, loss_fn]) or a dict with the keys model, "
                          "inputs and targets (and any argument of conveyor.check)")
    if not isinstance(made["model"], nn.Module) and not callable(made["model"]):
        raise ConfigError(f"--model {args.model}: its model is a "
                          f"{type(made['model']).__name__}, not an nn.Module")
    flags: dict[str, Any] = {
        "stages": args.stages, "schedule": args.schedule, "chunks": args.chunks,
        "virtual_stages": args.virtual_stages, "recompute": args.recompute,
        "deferred_batch_norm": args.deferred_batch_norm, "seed": args.seed,
        "rtol": args.rtol,
        "balance": _balance(args.balance),
        "split_at": _list(args.split_at, str, "--split-at") if args.split_at else None,
        "tensor_parallel": args.tensor_parallel,
        "tp_plan": _plan(args.tp_plan),
    }
    arguments = {**made, **{k: v for k, v in flags.items() if v is not None}}
    if args.balance:
        arguments.pop("split_at", None)
    if args.split_at:
        arguments.pop("balance", None)
    if args.recompute:
        arguments.pop("checkpoint", None)
    arguments.setdefault("chunks", 4)
    if arguments.get("tensor_parallel", 1) > 1:
        arguments.setdefault("tp_plan", "auto")
    if args.sample is not None:
        arguments["sample"] = _first_rows(arguments["inputs"], args.sample)
    arguments.setdefault("loss_fn", default_loss)
    return arguments


def _plan(text: str | None) -> Any:
    """``--tp-plan``: "auto", or a JSON object of module patterns and style names.

    Raises:
        ConfigError: neither.
    """
    from conveyor.errors import ConfigError

    if text is None or text == "auto":
        return text
    try:
        plan = json.loads(text)
    except json.JSONDecodeError:
        plan = None
    if not isinstance(plan, dict):
        raise ConfigError(f"--tp-plan {text}: give auto, or a JSON object such as "
                          '\'{"layers.*.up": "colwise", "layers.*.down": "rowwise"}\'')
    return plan


def _printing() -> bool:
    """Whether this process prints the report: in one process, or rank 0 of a job."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _balance(text: str | None) -> list[int] | str | None:
    if text is None or text == "time":
        return text
    return _list(text, int, "--balance")


def _first_rows(inputs: Any, rows: int) -> Any:
    """``--sample ROWS``: the batch's first rows, as the model takes them.

    Raises:
        ConfigError: ROWS is not a positive number.
    """
    import torch
    from conveyor.torchprivate import pytree

    from conveyor.errors import ConfigError

    if rows < 1:
        raise ConfigError(f"--sample {rows}: give the number of rows to trace with, e.g. 2")
    return pytree.tree_map_only(torch.Tensor, lambda t: t[:rows] if t.dim() else t, inputs)


def _list(text: str, kind: type, flag: str) -> list[Any]:
    from conveyor.errors import ConfigError

    try:
        return [kind(part.strip()) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"{flag} {text}: give comma-separated values, e.g. 2,2") from None


def default_loss(output: Any, targets: Any) -> Any:
    """Cross-entropy of the logits over targets that are not -100, as ``(sum, count)``,
    for integer targets; the mean squared error for floating ones."""
    import torch
    import torch.nn.functional as F

    logits = output["logits"] if isinstance(output, dict) or hasattr(output, "logits") \
        else output
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    if targets.is_floating_point():
        return F.mse_loss(logits, targets)
    total = F.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=_IGNORE,
                            reduction="sum")
    return total, torch.count_nonzero(targets != _IGNORE)
