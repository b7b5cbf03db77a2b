"""``conveyor train``: a Transformer language model on bundled text, trained by a pipeline.

With no arguments it trains a byte-level Transformer T(4, 512, 4) on the standard
library's Python sources, 2 stages on this machine (CPU threads, or GPUs), 8
micro-batches, 1F1B, for a few minutes; it shows progress, evaluates held-out bits per
byte against the unigram baseline, and leaves in ``--out`` a checkpoint, a training
curve, a Gantt chart and Chrome trace of one step, and ``summary.json``; at the end it
writes a sample from the model, generated with pipelined inference. The same command
under ``torchrun --nproc-per-node 2`` runs one stage per process.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from conveyor.engine.watchdog.deadline import Deadlines
from conveyor.distributed.faults.agreement import agree as agree_options
from conveyor.errors import ConfigError, ConveyorError, NonFiniteGradientError, NonFiniteLossError
from conveyor.observe.recording import record
from conveyor.schedules.timeline import Timeline
from conveyor.pipeline import Pipeline
from conveyor.runtime.export import refusal
from conveyor.train import saving
from conveyor.train.checkpoints import fit
from conveyor.train.checkstep import check_first_step
from conveyor.train.data import TextCorpus
from conveyor.train.elastic import (RESUME_AUTO, check_resumable, describe_replan, join_world,
                                    world_size)
from conveyor.train.language import evaluate, generate
from conveyor.train.options import OPTIONS_FILE, TrainConfig
from conveyor.train.outdir import RunLock, check_usable, writing
from conveyor.train.progress import Progress
from conveyor.train.setup import build
from conveyor.train.user.corpus import read_data
from conveyor.train.user.model import BuiltModel, build_model
from conveyor.train.report import write_report
from conveyor.train.stopping import StopSignals, agree, stages_not_finite, where_on_usr1

__all__: list[str] = []

_JOIN_AT_LEAST = 15.0  # seconds the rendezvous waits at least: processes start unevenly


def run(config: TrainConfig, *, resume: bool | str = False, check: bool = False,
        allow_change: frozenset[str] = frozenset()) -> int:
    """Trains as ``config`` says; returns the process exit code. With ``check``, one
    step of the pipeline is first compared with the plain model (``conveyor check``).
    ``resume="auto"`` continues the run in ``--out`` if it has a checkpoint, else starts
    it: the same command then serves torchrun's first start and its restarts.

    Ctrl-C (SIGINT) or SIGTERM stops the run after the step in flight, saves a
    checkpoint to resume from, and returns 128 + the signal's number. A resume refuses
    a checkpoint of another model or data (:mod:`conveyor.train.checkpoints.fit`) unless
    ``allow_change`` names the options that differ.

    ``--out`` is checked before any work, and locked while the run lasts: in one
    process at once, under torchrun by rank 0 once every process has joined.

    Raises:
        ConfigError: the options or ``--out`` do not allow the run, another run holds
            ``--out`` (nothing is written), or under torchrun the processes were given
            different options (each is named with its values).
        CheckpointError: resuming, the checkpoint cannot be read or does not fit.
        SaveError: a checkpoint or the summary could not be written (a full disk).
        ConveyorError: with ``check``, the pipeline differs from the plain model.
    """
    config.check()
    check_usable(Path(config.out))
    if config.export and (refused := refusal(Path(config.export))) is not None:
        raise ConfigError(f"--export: {refused}")
    join_world(processes=config.processes(), timeout=Deadlines.first,
               within=max(config.timeout, _JOIN_AT_LEAST) if config.timeout else None)
    if dist.is_initialized():  # every option that shapes the run, before any work
        agree_options({**asdict(config), "resume": resume, "check": check}, seconds=Deadlines.first,
                      what="options")
    if resume == RESUME_AUTO:
        resume = saving.exists(config.out)
    one_process = int(os.environ.get("WORLD_SIZE", "1")) == 1
    if config.processes() > config.stages and one_process:
        needs = " ".join(f"--{name} {value}" for name, value in (
            ("data-parallel", config.data_parallel), ("tensor-parallel", config.tensor_parallel))
            if value > 1) or f"--plan {config.plan} (replicas {config.replicas()})"
        raise ConfigError(f"{needs} needs processes: launch {config.processes()} with "
                          "torchrun")
    if config.shard and one_process:
        raise ConfigError("--shard shards each stage over its data-parallel processes: "
                          f"launch {config.stages * config.data_parallel} with torchrun, or "
                          "leave out --shard")
    lock = RunLock(Path(config.out))
    try:
        if one_process:
            lock.acquire()
        check_resumable(Path(config.out), bool(resume), saving.exists(config.out))
        if check:
            check_first_step(config)
        training = _Training.set_up(config, resume=bool(resume), lock=lock,
                                    allow=allow_change)
        training.announce()
        with StopSignals() as signals, where_on_usr1(training.pipe):
            stopped_by = training.train(signals)
        if stopped_by:
            return training.stop(stopped_by)
        training.complete()
        return 0
    finally:
        lock.release()


@dataclass
class _Training:
    """One run of ``conveyor train`` in this process: what it trains and how far it got."""

    config: TrainConfig
    corpus: TextCorpus
    built: BuiltModel  # the whole plain model (its layers live in the pipeline's stages)
    pipe: Pipeline
    optimizer: torch.optim.Optimizer
    scheduler: Any
    show: bool  # this process prints: always in one process, rank 0 under torchrun
    unigram: float  # held-out bits per byte (token) of the unigram baseline
    start: int = 0  # the first step this process takes (after the resumed one)
    step: int = 0  # steps done
    position: int = 0  # training windows read (the data's place, mid-epoch)
    history: list[dict[str, Any]] = field(default_factory=list)
    timeline: Timeline | None = None  # one recorded step, for the pictures
    rate: float = 0.0  # tokens per second, smoothed
    bubble: str = "?"  # of the recorded step
    began: float = 0.0  # time.monotonic() at the first step
    saved: int | None = None  # the step of the newest checkpoint in --out
    skipped: int = 0  # steps skipped for a loss or gradient that was not finite
    replan: str | None = None  # how the layout differs from the resumed checkpoint's
    identity: dict[str, Any] = field(default_factory=dict)  # the model and data (fit)
    notes: list[str] = field(default_factory=list)  # said on resume (pointer, changes)
    parameters: int = 0  # of the whole model (a rank holds its stages, or their shards)

    @property
    def intact(self) -> str:  # what a failed save leaves, for its message
        return ("there is no checkpoint yet" if self.saved is None
                else f"the checkpoint of step {self.saved} is intact")

    @property
    def out(self) -> Path:
        return Path(self.config.out)

    @classmethod
    def set_up(cls, config: TrainConfig, *, resume: bool, lock: RunLock,
               allow: frozenset[str] = frozenset()) -> _Training:
        """Builds the model, pipeline and optimizer; resuming, checks that the checkpoint
        is of this model and data, then loads it. Under torchrun, takes ``lock`` once
        the processes can agree on it."""
        show = not dist.is_initialized() or dist.get_rank() == 0
        built = build_model(config)
        corpus = read_data(config, built, show=show)
        identity = fit.identity(asdict(config), corpus.identity(), vocab=corpus.vocab,
                                model=built.identity)
        notes = fit.resume_notes(Path(config.out), asdict(config), identity,
                                 allow) if resume else []
        parameters = sum(p.numel() for p in built.model.parameters())  # before the split
        pipe, optimizer, scheduler = build(config, built)
        if dist.is_initialized():
            lock.acquire_together(writer=show, agree=lambda value: agree(pipe, value)[0])
        training = cls(config, corpus, built, pipe, optimizer, scheduler, show,
                       corpus.unigram_bits(), identity=identity, notes=notes,
                       parameters=parameters)
        if resume:
            extra = saving.load(training.out, model=pipe, optimizer=optimizer)
            training.start = training.step = training.saved = int(extra["step"])
            training.position = int(dict(extra.get("data") or {}).get(
                "position", training.step * config.batch))  # older checkpoints: by step
            training.history = list(extra["history"])
            scheduler.load_state_dict(extra["scheduler"])
            torch.set_rng_state(extra["rng"])
            training.replan = describe_replan(extra, config, balance=list(pipe.balance))
        return training

    def announce(self) -> None:
        """Clears what a killed save left, writes the run's options (for ``--resume``),
        and says what it trains."""
        if not self.show:
            return
        config, out = self.config, self.out
        stale = saving.remove_temporaries(out)  # under the lock: no save of another run
        if stale:
            print(f"removed {len(stale)} temporary file{'s' * (len(stale) > 1)} of an "
                  f"interrupted save: {', '.join(p.name for p in stale)}", flush=True)
        for note in self.notes:
            print(note, flush=True)
        if self.replan:
            print(f"re-planned ({self.replan}); resuming from the checkpoint of step "
                  f"{self.start}", flush=True)
        with writing(OPTIONS_FILE, out, self.intact):
            out.mkdir(parents=True, exist_ok=True)
            (out / OPTIONS_FILE).write_text(json.dumps(asdict(config), indent=2) + "\n")
        cut = (f"split at {', '.join(self.pipe.split_at)}" if self.pipe.split_at
               else f"balance {self.pipe.balance}")
        replicas, tensors = config.data_parallel, config.tensor_parallel
        kind = "shards (FSDP)" if config.shard else "replicas"
        layout = f"{config.stages} stage{'s' * (config.stages != 1)}" + (
            f" x {replicas} {kind}" if replicas > 1 else
            f" of {config.replicas()} replicas" if config.replicas() else "") + (
            f" x {tensors} tensor ranks" if tensors > 1 else "")
        print(f"training {self.built.name} ({self.parameters / 1e6:.2f}M parameters) on "
              f"{self.corpus.source}; {config.schedule}, {layout}, "
              f"{config.chunks} micro-batches, {cut}; held-out unigram "
              f"{self.unigram:.3f} bits/{self.corpus.unit}"
              + (f"; resuming at step {self.start}" if self.start else ""), flush=True)

    def train(self, signals: StopSignals) -> int:
        """Steps until the last step, the time limit or a signal; returns the number of
        the signal that stopped the run (0: none). Every rank stops at the same step."""
        config = self.config
        progress = Progress(config.steps, self.start, self.show)
        self.began = time.monotonic()
        record_at = min(self.start + 2, config.steps - 1)  # after warm-up, for the pictures
        stopped_by = 0
        with contextlib.closing(progress):
            while self.step < config.steps:
                loss = self._step(record_it=self.step == record_at)
                self._after_step(loss, progress)
                stopped_by, out_of_time = agree(
                    self.pipe, signals.received,
                    int(0 < config.time_limit < time.monotonic() - self.began))
                if stopped_by:
                    break
                if out_of_time and self.step < config.steps:
                    progress.write(f"stopping at step {self.step}: --time-limit "
                                   f"{config.time_limit:g} s")
                    break
        return stopped_by

    def _step(self, *, record_it: bool) -> float:
        """One optimizer step on this step's batch (recorded if asked); returns its loss
        (NaN for a step skipped as not finite)."""
        config, pipe = self.config, self.pipe
        replica, replicas = pipe.topology.data_rank, config.data_parallel
        inputs, targets = self.corpus.windows(self.position, config.batch, config.length,
                                              seed=config.seed)
        inputs, targets = inputs[replica::replicas], targets[replica::replicas]
        tick = time.perf_counter()
        try:
            if record_it:
                with record(pipe) as timeline:
                    loss = pipe.step(inputs, targets)
                self.timeline, self.bubble = timeline, f"{100 * timeline.mean_bubble:.0f}%"
            else:
                loss = pipe.step(inputs, targets)
        except (NonFiniteLossError, NonFiniteGradientError) as exc:  # every rank, no weight moved
            # the run's step is said by the run: not the pipeline's own count
            return self._not_finite(exc, re.sub(r",? (in )?step \d+ of this pipeline", "",
                                                str(exc).split(";")[0]))
        if pipe.certificate is not None and pipe.certificate.due_now:  # --verify-every
            print(f"verified at step {self.step + 1}", flush=True)
        norm = float(pipe.clip_grad_norm_(1.0))  # the same on every rank
        if not math.isfinite(norm):
            stages = stages_not_finite(pipe)
            return self._not_finite(NonFiniteGradientError(), (
                f"the gradients of stage{'s' * (len(stages) > 1)} "
                f"{', '.join(map(str, stages))} are not finite (norm {norm})"))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - tick
        tokens = config.batch * config.length
        self.rate = (tokens / seconds if not self.rate
                     else 0.9 * self.rate + 0.1 * tokens / seconds)
        self.step += 1
        self.position += config.batch
        return float(loss.item())

    def _not_finite(self, error: ConveyorError, what: str) -> float:
        """A step whose loss or gradient is not finite, before it reached the weights:
        skipped (``--on-nonfinite skip``; its batch is consumed, nothing else moves), or
        the run stops with ``error``, the weights of the step before saved.

        Raises:
            NonFiniteLossError, NonFiniteGradientError: ``--on-nonfinite stop``.
        """
        self.optimizer.zero_grad(set_to_none=True)
        failed = self.step + 1
        if self.config.on_nonfinite == "skip":
            self.skipped += 1
            self.step += 1
            self.position += self.config.batch
            if self.show:
                print(f"step {failed} skipped: {what} ({self.skipped} skipped so far)",
                      flush=True)
            return math.nan
        if self.saved != self.step:  # the weights are those of the step before: good
            self.save()
        kept = (f"the checkpoint of step {self.saved} in {self.out} holds them"
                if self.saved is not None else "no checkpoint was written")
        error.args = (f"step {failed}: {what}; the run stopped before it reached the "
                      f"weights, which are those of step {self.step} ({kept}); "
                      "--on-nonfinite skip skips such steps",)
        raise error

    def _after_step(self, loss: float, progress: Progress) -> None:
        """Notes the step in the history and the progress; evaluates and saves when due."""
        config = self.config
        entry: dict[str, Any] = {"step": self.step, "loss": loss}
        if math.isnan(loss):
            entry["skipped"] = True
        heldout, unit = f"heldout_{self.corpus.metric}", self.corpus.unit
        if self.step % config.eval_every == 0 or self.step == config.steps:
            entry[heldout] = evaluate(self.pipe, self.corpus, config)
            progress.write(f"step {self.step}: held-out {entry[heldout]:.3f} bits/{unit} "
                           f"(unigram {self.unigram:.3f})")
        self.history.append(entry)
        progress.update(self.step, {self.corpus.metric: f"{loss / math.log(2):.3f}",
                                    "tok/s": f"{self.rate:.0f}",
                                    "bubble": self.bubble})
        if self.step % config.save_every == 0:
            self.save()

    def save(self) -> None:
        """A checkpoint of this step: weights, optimizer, scheduler, random state, history.

        Raises:
            SaveError: it could not be written; the previous checkpoint is intact.
        """
        with writing(f"the checkpoint of step {self.step}", self.out, self.intact):
            saving.save(self.out, model=self.pipe, optimizer=self.optimizer,
                        extra={"step": self.step, "history": self.history,
                               "scheduler": self.scheduler.state_dict(),
                               "rng": torch.get_rng_state(), "config": asdict(self.config),
                               "identity": self.identity,
                               "data": {"position": self.position, "windows_per_epoch":
                                        self.corpus.windows_per_epoch(self.config.length)},
                               "world": world_size(), "balance": list(self.pipe.balance)})
        self.saved = self.step

    def stop(self, number: int) -> int:
        """Saves where signal ``number`` stopped the run (unless the step's checkpoint is
        there already); returns 128 + ``number``."""
        if self.saved != self.step:
            self.save()
        if self.show:
            print(f"stopped by {signal.Signals(number).name} after step {self.step}; "
                  f"checkpoint saved in {self.out}, continue with --resume", flush=True)
        return 128 + number

    def complete(self) -> None:
        """Evaluates the last step (if not yet), saves, samples, writes the summary."""
        config = self.config
        heldout = f"heldout_{self.corpus.metric}"
        evaluated = bool(self.history) and heldout not in self.history[-1]
        if evaluated:
            self.history[-1][heldout] = evaluate(self.pipe, self.corpus, config)
        if evaluated or self.saved != self.step:  # not the newest checkpoint again, in place
            self.save()
        sample = generate(self.pipe, self.corpus, config) if config.sample_bytes else ""
        if self.show:
            with writing("the summary", self.out, self.intact):
                write_report(self.out, config, self.history, self.unigram, self.timeline,
                             sample, time.monotonic() - self.began,
                             (self.step - self.start) * config.batch * config.length,
                             unit=self.corpus.unit)
        if config.export:  # every rank: each writes its stages
            self.pipe.save_pretrained(config.export, tokenizer=self.built.tokenizer,
                                      config=self.built.config)
            if self.show:
                print(f"exported the model to {config.export}")
