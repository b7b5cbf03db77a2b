"""The ``conveyor`` command line."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn, cast

from conveyor.engine.allocator import tune_malloc

__all__ = ["main"]

if TYPE_CHECKING:
    _Commands = argparse._SubParsersAction[argparse.ArgumentParser]  # add_subparsers()


def _prepare_process() -> None:
    """Settings that only work before torch starts threads (see conveyor.engine.allocator)."""
    # Idle OpenMP threads of the main thread would otherwise spin on a core that a
    # stage thread needs; libgomp reads this when torch loads it.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    tune_malloc()


def _lazy(module: str, function: str) -> Any:
    """The command's body, imported only when it runs (simulate and trace need no torch)."""
    def run(args: argparse.Namespace) -> int:
        return int(getattr(importlib.import_module(module), function)(args))
    return run


class _Parser(argparse.ArgumentParser):
    """A parser that matches options whole, never by a prefix (``--data`` is not
    ``--data-parallel``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)


class _CommandParser(_Parser):
    """A sub-command's parser: an option it does not know is refused with its own
    usage (``conveyor train --bogus`` shows train's, not the top-level one)."""

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras


def build_parser() -> argparse.ArgumentParser:
    """The ``conveyor`` parser: one sub-command each for demo, train, simulate, trace,
    plan, check and export; options matched whole."""
    from conveyor import __version__

    parser = _Parser(prog="conveyor", description="GPipe for PyTorch: pipeline training.")
    parser.add_argument("--version", action="version", version=f"conveyor {__version__}")
    commands = cast("_Commands", parser.add_subparsers(dest="command", required=True,
                                                        parser_class=_CommandParser))
    for add_command in (_demo_parser, _train_parser, _simulate_parser, _trace_parser,
                        _plan_parser, _check_parser, _export_parser):
        add_command(commands)
    return parser


def _demo_parser(commands: _Commands) -> None:
    """``conveyor demo``; its body is ``conveyor.train.demo.run``."""
    sub = commands.add_parser("demo", help="train a small model with GPipe on CPU threads "
                                           "and measure the speedup")
    sub.add_argument("--blocks", type=int, default=8, help="residual feed-forward blocks")
    sub.add_argument("--width", type=int, default=512, help="model width (hidden: 4x)")
    sub.add_argument("--stages", type=int, default=2, help="pipeline stages (CPU threads)")
    sub.add_argument("--chunks", type=int, default=8, help="micro-batches per batch")
    sub.add_argument("--batch", type=int, default=256)
    sub.add_argument("--steps", type=int, default=40)
    sub.add_argument("--lr", type=float, default=3e-4)
    sub.add_argument("--checkpoint", default="except_last",
                     choices=["always", "except_last", "never"])
    sub.add_argument("--seed", type=int, default=0)
    sub.set_defaults(run=_lazy("conveyor.train.demo", "run"))


def _train_parser(commands: _Commands) -> None:
    """``conveyor train``; its flags are the options of ``conveyor.train.options``."""
    sub = commands.add_parser("train", help="train a Transformer language model on bundled "
                                            "text with a pipeline (threads, or torchrun)")
    from conveyor.train.options import add_arguments  # torch-free

    add_arguments(sub)
    sub.set_defaults(run=_lazy("conveyor.cli.training", "train_command"))


def _simulate_parser(commands: _Commands) -> None:
    """``conveyor simulate``; its body is ``commands.simulate_command``."""
    sub = commands.add_parser("simulate", help="simulate a schedule: bubble, memory, timeline")
    sub.add_argument("--schedule", default="1f1b",
                     help="gpipe, 1f1b, interleaved-1f1b, zero-bubble, or a V shape "
                          "(zb-v, dualpipe-v, v-half, v-min: 2K stages, two per rank)")
    sub.add_argument("--stages", type=int, required=True, help="pipeline ranks K")
    sub.add_argument("--chunks", type=int, required=True, help="micro-batches M")
    sub.add_argument("--virtual-stages", type=int, default=1,
                     help="stages per rank V, for interleaved-1f1b; each does 1/V of a "
                          "rank's work")
    sub.add_argument("--costs", metavar="FILE",
                     help="a JSON cost model, one value per stage (CostModel.to_dict()); "
                          "instead of the five flags below")
    costs = "one rank's layers, per micro-batch, in units of your choice"
    sub.add_argument("--forward", type=float, metavar="X",
                     help=f"forward of {costs} (default 1: the unit)")
    sub.add_argument("--backward", type=float, metavar="X",
                     help="input-gradient pass I of the same layers (default 1); a full "
                          "backward B costs backward + weight")
    sub.add_argument("--weight", type=float, metavar="X",
                     help="weight-gradient pass W of the same layers (default 1)")
    sub.add_argument("--communication", type=float, metavar="X",
                     help="moving an activation or a gradient between ranks (default 0)")
    sub.add_argument("--activation-bytes", type=float, metavar="BYTES",
                     help="what one micro-batch's activations of one rank's layers hold "
                          "(default: count in micro-batches' worth)")
    sub.add_argument("--plot", help="draw the Gantt chart to this PNG")
    sub.add_argument("--trace", help="write a Chrome trace to this JSON file")
    sub.add_argument("--json", action="store_true", help="print machine-readable figures")
    sub.set_defaults(run=_lazy("conveyor.cli.commands", "simulate_command"))


def _trace_parser(commands: _Commands) -> None:
    """``conveyor trace``; its body is ``commands.trace_command``."""
    sub = commands.add_parser("trace", help="show a recorded timeline (Timeline.save)")
    sub.add_argument("file")
    sub.add_argument("--plot", help="draw the Gantt chart to this PNG")
    sub.add_argument("--chrome", help="write a Chrome trace to this JSON file")
    sub.add_argument("--json", action="store_true")
    sub.set_defaults(run=_lazy("conveyor.cli.commands", "trace_command"))


def _plan_parser(commands: _Commands) -> None:
    """``conveyor plan``; its body is ``commands.plan_command``."""
    sub = commands.add_parser(
        "plan", help="memory and schedule plan for a model family, or for your model",
        description="Per-stage memory (parameters, optimizer state, activations at the "
                    "schedule's peak) and the best schedule and number of micro-batches. "
                    "--model package.module:function plans your own model: the function "
                    "takes no arguments and returns the model (on the meta device if it "
                    "can: nothing is allocated), or (model, sample) with sample one batch "
                    "as the model takes it; a model alone gets token ids of --length. It "
                    "is cut at --split-at, or into --stages stages where conveyor.Pipeline "
                    "would cut it. Only schedules the runtime computes exactly on your "
                    "model are recommended: the top ones are checked in order with "
                    "conveyor check (float64, on a copy) until one matches; the excluded "
                    "ones are listed with the difference found.")
    sub.add_argument("--model", default="transformer",
                     help="transformer, convnet, or package.module:function returning your "
                          "model or (model, sample)")
    sub.add_argument("--split-at", metavar="NAME,...",
                     help="your model: the submodules where stages 1.. begin")
    sub.add_argument("--balance", choices=["parameters", "time"], default="parameters",
                     help="your model with --stages: choose the cut among its blocks by "
                          "parameters (default) or by forward+backward time on the sample, "
                          "as Pipeline's balance=None or 'time'")
    sub.add_argument("--no-verify", action="store_true",
                     help="your model: do not check (float64, on a copy) that the runtime "
                          "computes the recommended schedule exactly on it")
    sub.add_argument("--layers", type=int, default=24, help="blocks (transformer) or cells")
    sub.add_argument("--d-model", type=int, default=1024)
    sub.add_argument("--d-ff", type=int, default=4096)
    sub.add_argument("--heads", type=int, default=16)
    sub.add_argument("--vocab", type=int, default=32000)
    sub.add_argument("--length", type=int, default=512,
                     help="sequence length (and of the token ids your model gets without "
                          "a sample)")
    sub.add_argument("--channels", type=int, default=64, help="convnet stem channels")
    sub.add_argument("--image", type=int, default=224)
    sub.add_argument("--classes", type=int, default=1000)
    sub.add_argument("--batch", type=int, default=32, help="mini-batch size N")
    sub.add_argument("--devices", "--stages", dest="devices", type=int,
                     help="pipeline ranks K (needed for a family)")
    sub.add_argument("--memory", help="memory per device, e.g. 16GiB (needed for a family; "
                                      "beside --topology FILE it overrides the file's)")
    sub.add_argument("--optimizer", default="adam",
                     choices=["sgd", "momentum", "rmsprop", "adam", "adamw"])
    sub.add_argument("--no-rematerialize", action="store_true")
    sub.add_argument("--offload", action="store_true",
                     help="also weigh each plan with its activations offloaded to host "
                          "memory (offload=\"activations\") instead of recomputed")
    sub.add_argument("--flops", type=float,
                     help="device FLOP/s assumed (default: the --topology file's, else 1e14)")
    sub.add_argument("--top", type=int, default=8, help="options shown")
    sub.add_argument("--json", action="store_true")
    _cluster_arguments(sub)
    sub.set_defaults(run=_lazy("conveyor.cli.commands", "plan_command"))


def _cluster_arguments(sub: argparse.ArgumentParser) -> None:
    """``conveyor plan``'s flags of a cluster (``conveyor.cli.clusterplan``)."""
    cluster = sub.add_argument_group(
        "a cluster (PipeDream's planner: cut, replicas per stage, schedule, micro-batches "
        "and recomputation per stage, weighing links and memory)")
    cluster.add_argument("--topology", metavar="FILE",
                         help="the cluster as JSON or TOML (levels with size, bandwidth, "
                              "latency; memory; flops), or 'detect' for this machine")
    cluster.add_argument("--nodes", type=int, help="nodes (with --per-node)")
    cluster.add_argument("--per-node", type=int, help="devices per node")
    cluster.add_argument("--intra-bandwidth", help="within a node, e.g. 300GB/s")
    cluster.add_argument("--inter-bandwidth", help="between nodes, e.g. 200Gbps")
    cluster.add_argument("--intra-latency", help="e.g. 5us (default 0)")
    cluster.add_argument("--inter-latency", help="e.g. 20us (default 0)")
    cluster.add_argument("--uniform-replicas", action="store_true",
                         help="every stage as many replicas: D replicas of the whole "
                              "pipeline, each on its share of the batch")
    cluster.add_argument("--no-replicas", action="store_true",
                         help="one device per stage")
    cluster.add_argument("--profile-cache", metavar="DIR",
                         help="keep your model's timed profile here and reuse it")
    cluster.add_argument("--save", metavar="PLAN.json",
                         help="write the best plan, for Pipeline(plan=PipelinePlan.load(...))")


def _check_parser(commands: _Commands) -> None:
    """``conveyor check``; its flags and body are in ``conveyor.cli.checking``."""
    from conveyor.cli.checking import add_parser  # torch-free

    add_parser(commands, _lazy("conveyor.cli.checking", "check_command"))


def _export_parser(commands: _Commands) -> None:
    """``conveyor export``; its flags and body are in ``conveyor.cli.exporting``."""
    from conveyor.cli.exporting import add_parser  # torch-free

    add_parser(commands, _lazy("conveyor.cli.exporting", "export_command"))


def main(argv: Sequence[str] | None = None) -> int:
    _prepare_process()
    args = build_parser().parse_args(argv)
    return int(args.run(args))


def command() -> NoReturn:
    """The ``conveyor`` program (the console script and ``python -m conveyor``): ``main``,
    then the process ends with its code (after a process group, as
    ``conveyor.distributed.watch.exit_process`` ends it)."""
    end_command(main())


def end_command(code: int) -> NoReturn:
    """Ends the process of a ``conveyor`` command with ``code``: after a process group as
    ``conveyor.distributed.watch.exit_process`` ends it; a rank that a launcher started
    at once (:func:`_end_now`); else through ``sys.exit``."""
    watch = sys.modules.get("conveyor.distributed.watch")  # loaded: a group may have run
    if watch is not None and (watch.group_ran() or not _launched()):
        watch.exit_process(code)
    if _launched():
        _end_now(code)
    sys.exit(code)


def _launched() -> bool:
    """Whether a launcher (torchrun, or env:// by hand) started this process as a rank."""
    return "TORCHELASTIC_RUN_ID" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1


def _end_now(code: int) -> NoReturn:
    """Ends a rank's process with ``code`` at once, its output flushed. Without a process
    group (a refusal before it existed) the interpreter's finalization of torch can take
    seconds, and torchrun, seeing another rank end, kills this one meanwhile (-15 in
    place of the code the command returned)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    command()
