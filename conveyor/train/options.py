"""The options of ``conveyor train``: defaults, flags, config files and their checks.

Kept free of torch so that ``conveyor --help`` and the option checks are instant. An
option's value comes from, in order of precedence: its flag, the ``--config`` JSON file,
the default below.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from conveyor.errors import ConfigError, ConveyorError
from conveyor.schedules import SCHEDULES, build
from conveyor.train.elastic import plan_layout, resume_mode, under_torchrun

__all__: list[str] = []

OPTIONS_FILE = "options.json"  # in --out: the options of the run, for --resume
#: The options that shape the bundled Transformer (a ``--model`` of the user's has its own).
BUNDLED_SHAPE = ("layers", "width", "hidden", "heads", "dropout", "tie")


def _option(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass
class TrainConfig:
    """Every option of ``conveyor train`` (the flags, and the keys of ``--config``)."""

    model: str = _option("", "what to train: a Hugging Face model directory or its "
                             "config.json (its weights and tokenizer when it has them), or "
                             "package.module:function returning the model; '': the "
                             "bundled Transformer of --layers, --width, ...")
    data: str = _option("", "what to train on: a .txt, .md, .jsonl or .parquet file, or a "
                            "folder of them; '': the bundled Python sources")
    text_field: str = _option("text", "the key of each JSONL line (the Parquet column) that "
                                      "holds the text")
    layers: int = _option(4, "Transformer blocks L")
    width: int = _option(128, "model width (embedding and attention)")
    hidden: int = _option(512, "feed-forward width H")
    heads: int = _option(4, "attention heads A")
    length: int = _option(128, "sequence length in tokens (bytes without a tokenizer)")
    dropout: float = _option(0.0, "dropout probability")
    tie: bool = _option(True, "the output head shares the token embedding's weight (--no-tie: "
                              "a head of its own)")
    batch: int = _option(32, "sequences per mini-batch")
    stages: int = _option(2, "pipeline stages (under torchrun: processes / (data-parallel "
                             "x tensor-parallel))")
    data_parallel: int = _option(1, "replicas of the pipeline, each on a share of the "
                                    "batch (under torchrun)")
    tensor_parallel: int = _option(1, "processes each stage's modules are split over "
                                      "(Megatron-style, under torchrun): a Hugging Face "
                                      "model by its own plan, the bundled Transformer's "
                                      "feed-forward layers")
    shard: bool = _option(False, "hold 1/D of each stage's weights, gradients and AdamW "
                                 "state per replica (FSDP2) instead of a whole copy")
    rebalance: bool = _option(False, "measure the stages while training and move layers "
                                     "between them when that makes the step >10% faster")
    devices: str = _option("auto", "a device for all stages, or one per stage, comma-"
                                   "separated (cpu, cuda:1, ...); auto: the GPUs in turn, "
                                   "else the CPU")
    chunks: int = _option(8, "micro-batches per mini-batch M")
    schedule: str = _option("1f1b", "one of " + ", ".join(SCHEDULES))
    virtual_stages: int = _option(1, "stages per rank, for interleaved-1f1b")
    checkpoint_mode: str = _option("except_last",
                                   "re-materialization: always, except_last or never, or "
                                   "one per stage, comma-separated (never,always)")
    plan: str = _option("", "a plan file (conveyor plan --model transformer ... --save "
                            "FILE): its cut, stages, schedule, chunks, re-materialization "
                            "per stage and replicas replace those options")
    steps: int = _option(600, "optimizer steps in the whole run")
    lr: float = _option(3e-3, "peak learning rate (AdamW, warm-up then cosine)")
    warmup: int = _option(20, "warm-up steps")
    seed: int = _option(0, "seed of the initialization, the batches and the sample")
    eval_every: int = _option(50, "steps between held-out evaluations")
    eval_batches: int = _option(8, "held-out batches per evaluation")
    save_every: int = _option(100, "steps between checkpoints")
    on_nonfinite: str = _option("stop", "a step whose loss or gradient is NaN or infinite: "
                                        "stop the run before it reaches the weights (exit "
                                        "1), or skip it (counted and reported)")
    time_limit: float = _option(0.0, "seconds after which the run stops early and saves "
                                     "(0: none)")
    timeout: float = _option(0.0, "seconds a stage may take for one action, and the pipeline "
                                  "without progress (0: fitted to the step time)")
    verify_every: int = _option(0, "re-run every N-th step through the unpartitioned model, "
                                   "stage by stage, and stop the run if its loss or a "
                                   "gradient differs from the pipeline's (about one more "
                                   "forward and backward per N steps; 0: never)")
    sample_bytes: int = _option(240, "bytes (tokens, with a tokenizer) of text generated at "
                                     "the end (0: none)")
    out: str = _option("runs/default", "output directory")
    export: str = _option("", "at the end, also write the trained model into this new or "
                              "empty folder as a model directory (safetensors files by the "
                              "plain model's names and their index; '': none)")

    def check(self) -> None:
        """Raises ConfigError (one line) for options that cannot work together. A
        ``--plan`` sets the options it decides first."""
        self._apply_plan()
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"unknown schedule {self.schedule!r}; choose one of "
                              + ", ".join(SCHEDULES))
        if self.on_nonfinite not in ("stop", "skip"):
            raise ConfigError(f"unknown --on-nonfinite {self.on_nonfinite!r}; choose stop or "
                              "skip")
        modes = self.checkpoint_mode.split(",")
        if any(mode not in ("always", "except_last", "never") for mode in modes):
            raise ConfigError(f"unknown --checkpoint-mode {self.checkpoint_mode!r}; choose "
                              "always, except_last or never, or one per stage "
                              "(never,always)")
        if len(modes) > 1 and len(modes) != self.stages * self.virtual_stages:
            raise ConfigError(f"--checkpoint-mode {self.checkpoint_mode} names {len(modes)} "
                              f"modes for {self.stages * self.virtual_stages} stages")
        for name in ("layers", "width", "hidden", "heads", "length", "batch", "stages",
                     "data_parallel", "tensor_parallel", "chunks", "virtual_stages", "steps",
                     "warmup", "eval_every", "eval_batches", "save_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{_flag(name)} must be at least 1, "
                                  f"got {getattr(self, name)}")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"--dropout must be in [0, 1), got {self.dropout}")
        if self.sample_bytes < 0:
            raise ConfigError(f"--sample-bytes must be at least 0, got {self.sample_bytes}")
        for name in ("lr", "time_limit", "timeout", "verify_every"):
            value = getattr(self, name)
            if not (value > 0 or (value == 0 and name != "lr")) or value != value:
                least = "greater than 0" if name == "lr" else "at least 0"
                raise ConfigError(f"{_flag(name)} must be {least}, got {value}")
        if self.batch % self.data_parallel:
            raise ConfigError(f"--batch {self.batch} does not split evenly into "
                              f"--data-parallel {self.data_parallel} replicas")
        share = self.batch // self.data_parallel
        if self.chunks > share:
            whose = "" if self.data_parallel == 1 else " per replica"
            raise ConfigError(f"--chunks {self.chunks} is more than the batch of {share} "
                              f"sequences{whose}; use --chunks <= {share}")
        if not self.model:
            self._check_bundled()
        try:  # the schedule fits the stages and micro-batches
            build(self.schedule, self.stages, self.chunks, virtual_stages=self.virtual_stages)
        except ConveyorError as exc:
            raise ConfigError(str(exc)) from exc
        self._check_tensor_parallel()
        if self.shard and self.rebalance:
            raise ConfigError("--rebalance cannot move layers sharded by --shard yet; drop one")

    def balance(self) -> list[int] | None:
        """The layers per stage ``--plan`` cuts (None: the pipeline balances)."""
        if not self.plan:
            return None
        from conveyor.planner import PipelinePlan

        return PipelinePlan.load(self.plan).balance

    def replicas(self) -> list[int] | None:
        """The replicas per stage of a ``--plan`` that replicates its stages unevenly
        (one pipeline of their sum of processes); None: none, or ``--data-parallel``."""
        if not self.plan:
            return None
        from conveyor.planner import PipelinePlan

        replicas = PipelinePlan.load(self.plan).replicas
        return replicas if len(set(replicas)) > 1 else None

    def processes(self) -> int:
        """The processes the run needs."""
        replicas = self.replicas()
        return sum(replicas) if replicas else \
            self.stages * self.data_parallel * self.tensor_parallel

    def recompute(self) -> str | list[str]:
        """``--checkpoint-mode`` as the pipeline takes it: one mode, or one per stage."""
        modes = self.checkpoint_mode.split(",")
        return modes if len(modes) > 1 else modes[0]

    def _apply_plan(self) -> None:
        if not self.plan:
            return
        from conveyor.planner import PipelinePlan

        try:
            options = PipelinePlan.load(self.plan).pipeline_options()
        except ConveyorError as exc:
            raise ConfigError(f"--plan {self.plan}: {exc}") from None
        layers = self.layers + 3
        if not self.model and sum(options.get("balance", [])) != layers:
            raise ConfigError(
                f"--plan {self.plan} cuts {sum(options.get('balance', []))} layers; this "
                f"run's model has {layers} ({self.layers} blocks, embedding, norm, head): "
                f"plan it with conveyor plan --model transformer --layers {self.layers} "
                f"--d-model {self.width} --d-ff {self.hidden} --heads {self.heads} --vocab "
                f"256 --length {self.length} --batch {self.batch} ... --save FILE")
        recompute = options["recompute"]
        self.stages, self.virtual_stages = len(options["balance"]), 1
        self.chunks, self.schedule = options["chunks"], options["schedule"]
        uneven = not isinstance(options["data_parallel"], int)  # one pipeline: see replicas()
        self.data_parallel = 1 if uneven else options["data_parallel"]
        self.checkpoint_mode = recompute if isinstance(recompute, str) else ",".join(recompute)

    def _check_bundled(self) -> None:
        """The checks of the bundled Transformer's shape (a ``--model`` has its own)."""
        if self.width % self.heads:
            raise ConfigError(f"--width {self.width} is not divisible by --heads {self.heads}")
        layers = self.layers + 3
        if self.stages * self.virtual_stages > layers:
            raise ConfigError(
                f"--stages {self.stages} x --virtual-stages {self.virtual_stages} asks for more "
                f"stages than the model's {layers} layers ({self.layers} blocks, embedding, "
                "norm and head); use fewer stages or more --layers"
            )
        self._check_memory()

    def _check_tensor_parallel(self) -> None:
        """Refuses what a tensor-parallel run cannot do yet (one line each)."""
        if self.tensor_parallel == 1:
            return
        size = f"--tensor-parallel {self.tensor_parallel}"
        if self.rebalance:
            raise ConfigError(f"--rebalance cannot move tensor-parallel layers yet; drop "
                              f"--rebalance or {size}")
        if self.shard:
            raise ConfigError(f"--shard beside {size} is not in conveyor train yet: a "
                              "checkpoint would have to hold FSDP's shards of each tensor "
                              "rank's part as one tensor; drop --shard or --tensor-parallel")
        if self.replicas():
            raise ConfigError(f"--plan {self.plan} replicates its stages unevenly, which "
                              f"{size} cannot split yet; plan even replicas, or drop {size}")
        if not self.model and self.hidden % self.tensor_parallel:
            raise ConfigError(f"{size} splits the bundled Transformer's feed-forward layers, "
                              f"but --hidden {self.hidden} is not divisible by "
                              f"{self.tensor_parallel}")

    def _check_memory(self) -> None:
        """Refuses a length whose attention alone would not fit in this machine's memory
        (it would not fail: it would swap, or compute for hours before the first step)."""
        try:
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (AttributeError, ValueError, OSError):
            return
        rows = -(-self.batch // (self.data_parallel * self.chunks))
        scores = rows * self.heads * self.length ** 2 * 4  # float32, one layer
        if scores > memory // 2:
            raise ConfigError(
                f"--length {self.length}: one micro-batch's attention scores alone take "
                f"{scores / 2**30:.0f} GiB ({rows} sequences x {self.heads} heads x "
                f"{self.length}^2 x 4 bytes), more than half of this machine's "
                f"{memory / 2**30:.0f} GiB; use a shorter --length, or more --chunks")


_METAVARS = {int: "N", float: "X", str: "NAME"}
_NAMED_METAVARS = {"out": "DIR", "export": "DIR", "model": "DIR|MODULE:FUNCTION", "data": "PATH",
                   "text_field": "KEY"}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``conveyor train``: one per option, plus --config, --resume, --verbose
    and --check, which say how to run rather than what to train (not saved with the run)."""
    parser.add_argument("--config", metavar="FILE",
                        help="JSON file of options (flags given as well take precedence)")
    parser.add_argument("--resume", nargs="?", const=True, default=False, type=resume_mode,
                        metavar="auto",
                        help="continue the run whose checkpoint is in --out; --resume auto: "
                             "if there is one, else start it (for torchrun --max-restarts)")
    parser.add_argument("--allow-change", default="", metavar="OPTIONS",
                        help="with --resume: the options of the model or data (comma-"
                             "separated: heads,length,seed,...) that may differ from the "
                             "checkpoint's, on purpose; without it a resume refuses them")
    parser.add_argument("--verbose", action="store_true",
                        help="log every action of the pipeline to stderr (the 'conveyor' "
                             "logger at DEBUG)")
    parser.add_argument("--check", action="store_true",
                        help="first run one step of this pipeline beside the plain model "
                             "(float64, as conveyor check does) and stop unless they match")
    for option in fields(TrainConfig):
        kind = type(option.default)
        # argparse formats help with %: a literal one (">10% faster") must be doubled.
        text = f"{option.metadata['help']} (default {option.default})".replace("%", "%%")
        if kind is bool:  # --shard and --no-shard (the latter to resume unsharded)
            parser.add_argument(_flag(option.name), action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=text)
            continue
        parser.add_argument(_flag(option.name), type=kind, default=argparse.SUPPRESS,
                            metavar=_NAMED_METAVARS.get(option.name, _METAVARS[kind]),
                            help=text)


def from_arguments(args: argparse.Namespace) -> TrainConfig:
    """The options of a ``conveyor train`` command line, checked.

    With ``--resume``, options not given come from the run being resumed (its
    ``options.json``). Under torchrun, the layout not given is planned for the world
    (see :func:`conveyor.train.elastic.plan_layout`): ``--stages`` is the number of
    processes over ``--data-parallel``, whatever the resumed run had.

    Raises:
        ConfigError: the config file cannot be read or has unknown keys, or the options
            do not work together.
    """
    values: dict[str, Any] = {}
    if args.config:
        values.update(_read_config(args.config))
    values.update({f.name: getattr(args, f.name) for f in fields(TrainConfig)
                   if hasattr(args, f.name)})
    given = set(values)
    shaping = sorted(given & set(BUNDLED_SHAPE))
    if values.get("model") and shaping:
        raise ConfigError(f"{', '.join(map(_flag, shaping))} shape{'s' * (len(shaping) == 1)} "
                          f"the bundled Transformer; --model {values['model']} brings its "
                          "own: leave them out")
    if getattr(args, "resume", False):
        saved = Path(values.get("out", TrainConfig.out)) / OPTIONS_FILE
        if saved.exists():  # the run's own options, under what this command line says
            kept = {k: v for k, v in _read_config(saved).items()
                    if k != "export"}  # a folder written at the end: the run's, not kept
            values = {**kept, **values}
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 or under_torchrun():
        values = plan_layout({**asdict(TrainConfig()), **values}, given=given, world=world)
    config = TrainConfig(**values)
    config.check()
    return config


def _read_config(path: str | Path) -> dict[str, Any]:
    try:
        values = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read the config file {path}: {exc}") from exc
    if not isinstance(values, dict):
        raise ConfigError(f"the config file {path} must hold a JSON object of options")
    options = {f.name: f for f in fields(TrainConfig)}
    unknown = sorted(set(values) - set(options))
    if unknown:
        raise ConfigError(f"{path} has unknown options {unknown}; known: {sorted(options)}")
    for name, value in values.items():
        kind: type = type(options[name].default)
        if not isinstance(value, kind) and not (kind is float and isinstance(value, int)):
            raise ConfigError(f"{path}: option {name!r} must be a {kind.__name__}, "
                              f"got {value!r}")
        values[name] = kind(value)
    return values


def allowed_changes(text: str) -> frozenset[str]:
    """``--allow-change heads,length`` as option names (``all``: any).

    Raises:
        ConfigError: a name that is not an option of the model or the data.
    """
    names = frozenset(n.strip().replace("-", "_") for n in text.split(",") if n.strip())
    known = {"model", "layers", "width", "hidden", "heads", "length", "tie", "vocab", "corpus",
             "seed", "all"}
    unknown = sorted(names - known)
    if unknown:
        raise ConfigError(f"--allow-change {text}: {', '.join(unknown)} "
                          f"{'is' if len(unknown) == 1 else 'are'} not an option of the model "
                          f"or data; choose from {', '.join(sorted(known))}")
    return names
