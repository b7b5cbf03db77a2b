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

import argparse
import json
import math
import os
import signal
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from conveyor.train import saving
from conveyor.train.data import TextCorpus, text_corpus
from conveyor.errors import ConfigError, ConveyorError
from conveyor.train.models import transformer_lm
from conveyor.distributed.pipeline import Pipeline
from conveyor.observe.recording import record
from conveyor.observe.trace import Timeline, plot_timelines
from conveyor.train.options import OPTIONS_FILE, TrainConfig, from_arguments

__all__: list[str] = []


def next_byte_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


class _Progress:
    """A tqdm bar on a terminal when tqdm is installed, else a line every 10 seconds;
    silent off rank 0."""

    def __init__(self, total: int, start: int, show: bool) -> None:
        self.show, self.bar, self.last = show, None, 0.0
        if show and sys.stdout.isatty():  # in a log, lines now and then read better
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True,
                                file=sys.stdout)
            except ImportError:
                pass

    def update(self, step: int, figures: dict[str, str]) -> None:
        if not self.show:
            return
        if self.bar is not None:
            self.bar.set_postfix(figures, refresh=False)
            self.bar.update(1)
        elif time.monotonic() - self.last > 10:
            self.last = time.monotonic()
            print(f"step {step}  " + "  ".join(f"{k} {v}" for k, v in figures.items()),
                  flush=True)

    def write(self, text: str) -> None:
        if self.show:
            if self.bar is not None:
                self.bar.write(text)
            else:
                print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def train_command(args: argparse.Namespace) -> int:
    """``conveyor train``: errors end it with one line on stderr and a non-zero code."""
    rank = int(os.environ.get("RANK", "0"))
    try:
        return run(from_arguments(args), resume=args.resume)
    except (ConfigError, saving.CheckpointError) as exc:
        if rank == 0:  # every rank read the same options and checkpoint
            print(f"conveyor train: error: {exc}", file=sys.stderr)
        return 2
    except ConveyorError as exc:
        where = f" (rank {rank})" if dist.is_initialized() else ""
        print(f"conveyor train: error{where}: {exc}", file=sys.stderr)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run(config: TrainConfig, *, resume: bool = False) -> int:
    """Trains as ``config`` says; returns the process exit code.

    Ctrl-C (SIGINT) or SIGTERM stops the run after the step in flight, saves a
    checkpoint to resume from, and returns 128 + the signal's number.
    """
    config.check()
    out = Path(config.out)
    if saving.exists(out) and not resume:
        raise ConfigError(f"{out} already holds a checkpoint; pass --resume to continue it "
                          "or choose another --out")
    if resume and not saving.exists(out):
        raise ConfigError(f"--resume: there is no checkpoint in {out}")
    if config.data_parallel > 1 and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        raise ConfigError(f"--data-parallel {config.data_parallel} needs processes: launch "
                          f"{config.stages * config.data_parallel} with torchrun")

    corpus = text_corpus()
    model, pipe, optimizer, scheduler = _build(config)
    replica, replicas = pipe.topology.data_rank, config.data_parallel
    show = not dist.is_initialized() or dist.get_rank() == 0
    start, history = 0, []
    if resume:
        extra = saving.load(out, model=pipe, optimizer=optimizer)
        start, history = int(extra["step"]), list(extra["history"])
        scheduler.load_state_dict(extra["scheduler"])
        torch.set_rng_state(extra["rng"])
    unigram = corpus.unigram_bits_per_byte()
    if show:
        out.mkdir(parents=True, exist_ok=True)
        (out / OPTIONS_FILE).write_text(json.dumps(asdict(config), indent=2) + "\n")
        parameters = sum(p.numel() for p in model.parameters())  # the whole model's
        layout = f"{config.stages} stages" + (f" x {replicas} replicas" if replicas > 1 else "")
        print(f"training T({config.layers}, {config.hidden}, {config.heads}) width "
              f"{config.width} ({parameters / 1e6:.2f}M parameters) on {len(corpus.train)} "
              f"bytes of Python; {config.schedule}, {layout}, {config.chunks} micro-batches, "
              f"balance {pipe.balance}; held-out unigram {unigram:.3f} bits/byte"
              + (f"; resuming at step {start}" if start else ""), flush=True)

    progress = _Progress(config.steps, start, show)
    timeline: Timeline | None = None
    began, step, tokens = time.monotonic(), start, config.batch * config.length
    rate, bubble, stopped_by = 0.0, "?", 0
    record_at = min(start + 2, config.steps - 1)  # a step after warm-up, for the pictures
    with _StopSignals() as signals:
        while step < config.steps:
            inputs, targets = corpus.batch(step, config.batch, config.length, seed=config.seed)
            inputs, targets = inputs[replica::replicas], targets[replica::replicas]
            tick = time.perf_counter()
            if step == record_at:
                with record(pipe) as timeline:
                    loss = pipe.step(inputs, targets)
                bubble = f"{100 * timeline.mean_bubble:.0f}%"
            else:
                loss = pipe.step(inputs, targets)
            pipe.clip_grad_norm_(1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            seconds = time.perf_counter() - tick
            rate = tokens / seconds if not rate else 0.9 * rate + 0.1 * tokens / seconds
            step += 1
            entry: dict[str, Any] = {"step": step, "loss": loss.item()}
            if step % config.eval_every == 0 or step == config.steps:
                entry["heldout_bpb"] = evaluate(pipe, corpus, config)
                progress.write(f"step {step}: held-out {entry['heldout_bpb']:.3f} bits/byte "
                               f"(unigram {unigram:.3f})")
            history.append(entry)
            progress.update(step, {"bpb": f"{entry['loss'] / math.log(2):.3f}",
                                   "tok/s": f"{rate:.0f}",
                                   "bubble": bubble})
            if step % config.save_every == 0:
                _save(out, pipe, optimizer, scheduler, step, history, config)
            # Every rank stops at the same step, whichever of them got the signal.
            stopped_by, out_of_time = _agree(
                pipe, signals.received, int(time.monotonic() - began > config.time_limit))
            if stopped_by:
                break
            if out_of_time and step < config.steps:
                progress.write(f"stopping at step {step}: --time-limit {config.time_limit:g} s")
                break
    progress.close()
    if stopped_by:
        _save(out, pipe, optimizer, scheduler, step, history, config)
        if show:
            print(f"stopped by {signal.Signals(stopped_by).name} after step {step}; "
                  f"checkpoint saved in {out}, continue with --resume", flush=True)
        return 128 + stopped_by
    if history and "heldout_bpb" not in history[-1]:
        history[-1]["heldout_bpb"] = evaluate(pipe, corpus, config)
    _save(out, pipe, optimizer, scheduler, step, history, config)
    sample = generate(pipe, corpus, config) if config.sample_bytes else ""
    if show:
        _finish(out, config, history, unigram, timeline, sample,
                time.monotonic() - began, (step - start) * tokens)
    return 0


def _build(config: TrainConfig) -> tuple[nn.Module, Pipeline, torch.optim.Optimizer, Any]:
    """The model, its pipeline, AdamW, and its schedule: linear warm-up, cosine decay."""
    torch.manual_seed(config.seed)
    model = transformer_lm(config.layers, config.width, config.hidden, config.heads,
                           vocab=256, max_length=config.length, dropout=config.dropout,
                           tie=True)
    pipe = Pipeline(model, stages=config.stages, chunks=config.chunks, schedule=config.schedule,
                    virtual_stages=config.virtual_stages, checkpoint=config.checkpoint_mode,
                    devices=stage_devices(config), data_parallel=config.data_parallel,
                    loss_fn=next_byte_loss)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=config.lr, weight_decay=0.01)

    def rate(step: int) -> float:
        warm = min(1.0, (step + 1) / config.warmup)
        return warm * 0.5 * (1 + math.cos(math.pi * min(step, config.steps) / config.steps))

    return model, pipe, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, rate)


def stage_devices(config: TrainConfig) -> list[torch.device] | None:
    """The device of each pipeline rank in one process (None under torchrun, where
    each process has its own).

    Raises:
        ConfigError: ``--devices`` names a device that does not exist, or not one per
            stage.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        if config.devices != "auto":
            raise ConfigError("under torchrun each process uses its own device (its "
                              "LOCAL_RANK's GPU, else the CPU); leave out --devices")
        return None
    if config.devices == "auto":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return [torch.device("cuda", s % gpus) if gpus else torch.device("cpu")
                for s in range(config.stages)]
    names = config.devices.split(",")
    if len(names) == 1:
        names = names * config.stages
    if len(names) != config.stages:
        raise ConfigError(f"--devices names {len(names)} devices for {config.stages} stages; "
                          "give one for all, or one per stage")
    devices = []
    for name in names:
        try:
            device = torch.device(name.strip())
        except RuntimeError as exc:
            raise ConfigError(f"--devices: {name!r} is not a device (cpu, cuda, cuda:1, "
                              "...)") from exc
        if device.type == "cuda" and (not torch.cuda.is_available() or (
                device.index or 0) >= torch.cuda.device_count()):
            raise ConfigError(f"--devices: there is no {device} here ("
                              f"{torch.cuda.device_count()} CUDA devices)")
        devices.append(device)
    return devices


class _StopSignals:
    """SIGINT and SIGTERM ask the training loop to stop after the step in flight.

    ``received`` is the number of the first such signal (0: none). A second Ctrl-C
    interrupts at once, without saving (the last periodic checkpoint stays).
    """

    def __init__(self) -> None:
        self.received = 0
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> _StopSignals:
        if threading.current_thread() is threading.main_thread():
            for number in (signal.SIGINT, signal.SIGTERM):
                self.previous[number] = signal.signal(number, self._handle)
        return self

    def _handle(self, number: int, frame: Any) -> None:
        if self.received and number == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = self.received or number

    def __exit__(self, *exc: object) -> None:
        for number, handler in self.previous.items():
            signal.signal(number, handler)


def _agree(pipe: Pipeline, *values: int) -> tuple[int, ...]:
    """Each of ``values``, the largest over every process of the run."""
    if not dist.is_initialized():
        return values
    flags = torch.tensor(values, device=pipe.topology.device)  # set under torchrun
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return tuple(int(v) for v in flags.tolist())


def _save(out: Path, pipe: Pipeline, optimizer: torch.optim.Optimizer, scheduler: Any,
          step: int, history: list[dict[str, Any]], config: TrainConfig) -> None:
    saving.save(out, model=pipe, optimizer=optimizer,
                extra={"step": step, "history": history, "scheduler": scheduler.state_dict(),
                       "rng": torch.get_rng_state(), "config": asdict(config)})


@torch.no_grad()
def evaluate(pipe: Pipeline, corpus: TextCorpus, config: TrainConfig) -> float:
    """Held-out bits per byte, over ``eval_batches`` fixed batches."""
    pipe.eval()
    total = torch.zeros((), dtype=torch.float64)
    for index in range(config.eval_batches):
        inputs, targets = corpus.batch(index, config.batch, config.length, seed=config.seed,
                                       heldout=True)
        logits = pipe.eval_step(inputs)
        if logits is not None:
            total += next_byte_loss(logits.float(), targets.to(logits.device)).double().cpu()
    pipe.train()
    total = pipe.from_last_stage(total)
    return float(total) / config.eval_batches / math.log(2)


@torch.no_grad()
def generate(pipe: Pipeline, corpus: TextCorpus, config: TrainConfig) -> str:
    """Continues a held-out prompt by sampling (temperature 0.8) with pipelined inference:
    ``chunks`` samples at once, one per micro-batch; returns the first."""
    pipe.eval()
    generator = torch.Generator().manual_seed(config.seed)
    context = corpus.prompt(min(48, config.length)).repeat(config.chunks, 1)
    for _ in range(config.sample_bytes):
        logits = pipe.eval_step(context[:, -config.length:])
        chosen = torch.zeros(config.chunks, 1, dtype=torch.long)
        if logits is not None:
            probabilities = torch.softmax(logits[:, -1].float().cpu() / 0.8, dim=-1)
            chosen = torch.multinomial(probabilities, 1, generator=generator)
        context = torch.cat([context, pipe.from_last_stage(chosen)], dim=1)
    pipe.train()
    return bytes(context[0].tolist()).decode("utf-8", errors="replace")


def _finish(out: Path, config: TrainConfig, history: list[dict[str, Any]], unigram: float,
            timeline: Timeline | None, sample: str, seconds: float, tokens: int) -> None:
    """Writes the summary and pictures; ``tokens`` were trained on in ``seconds``."""
    final = next(e["heldout_bpb"] for e in reversed(history) if "heldout_bpb" in e)
    written = ["checkpoint", "summary.json"]
    if timeline is not None:  # None when the resumed run had no step left to take
        timeline.save(out / "step.timeline.json")
        timeline.save_chrome_trace(out / "step.trace.json")
        written += ["step.timeline.json", "step.trace.json"]
    try:
        _plot_curve(history, unigram, out / "curve.png")
        written.append("curve.png")
        if timeline is not None:
            plot_timelines([timeline], out / "step.png",
                           titles=[f"measured {config.schedule} step"])
            written.append("step.png")
    except ImportError:
        print("matplotlib is not installed: no pictures (pip install 'conveyor[plots]')")
    summary = {"heldout_bpb": final, "unigram_bpb": unigram, "steps": history[-1]["step"],
               "final_loss": history[-1]["loss"], "seconds": seconds,
               "tokens_per_second": tokens / seconds if seconds else 0.0,
               "bubble": timeline.mean_bubble if timeline else None,
               "config": asdict(config), "history": history, "sample": sample}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\nheld-out {final:.3f} bits/byte against the unigram's {unigram:.3f}, after "
          f"{history[-1]['step']} steps in {seconds:.0f} s")
    print(f"wrote {out}/: {', '.join(written)}")
    print("\nsample (pipelined inference, from a held-out prompt):\n" + sample)


def _plot_curve(history: list[dict[str, Any]], unigram: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6.5, 3.6))
    steps = [e["step"] for e in history]
    axis.plot(steps, [e["loss"] / math.log(2) for e in history], color="#4C72B0", alpha=0.6,
              label="training batch")
    evaluated = [e for e in history if "heldout_bpb" in e]
    axis.plot([e["step"] for e in evaluated], [e["heldout_bpb"] for e in evaluated], "o-",
              color="#DD8452", label="held-out")
    axis.axhline(unigram, color="grey", linestyle="--", label="unigram baseline")
    axis.set_xlabel("step")
    axis.set_ylabel("bits per byte")
    axis.legend(fontsize=8)
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
