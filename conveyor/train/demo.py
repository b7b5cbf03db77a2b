"""``conveyor demo``: train a small model with GPipe on CPU threads, show the speedup."""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from conveyor.gpipe import GPipe
from conveyor.graph.balance import solve_balance
from conveyor.train.models import feed_forward_stack

__all__: list[str] = []


def _median_seconds(step: Callable[[], object], repeat: int) -> float:
    step()  # warm-up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    width = args.width
    teacher = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))
    teacher.requires_grad_(False)
    model = feed_forward_stack(args.blocks, width, 4 * width, residual=True)
    plain = copy.deepcopy(model)
    balance = solve_balance([1.0] * args.blocks, args.stages)
    pipe = GPipe(model, balance, devices=["cpu"] * args.stages, chunks=args.chunks,
                 checkpoint=args.checkpoint)
    optimizer = torch.optim.Adam(pipe.parameters(), lr=args.lr)
    print(f"GPipe: {args.blocks} residual blocks of Linear({width},{4 * width})-GELU-Linear, "
          f"balance {balance} on {args.stages} CPU threads, {args.chunks} micro-batches, "
          f"checkpoint={args.checkpoint!r}")
    print(f"learning y = teacher(x) with MSE loss, batch {args.batch}, Adam lr {args.lr}")
    for step in range(1, args.steps + 1):
        x = torch.randn(args.batch, width)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(pipe(x), teacher(x))
        loss.backward()
        optimizer.step()
        if step == 1 or step % max(1, args.steps // 10) == 0:
            print(f"  step {step:4d}  loss {loss.item():.5f}")

    x = torch.randn(args.batch, width)
    y = teacher(x)

    def pipelined(pipeline: GPipe) -> Callable[[], None]:
        def step() -> None:
            nn.functional.mse_loss(pipeline(x), y).backward()
        return step

    def sequential() -> None:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for xm, ym in zip(x.chunk(args.chunks), y.chunk(args.chunks)):
                (nn.functional.mse_loss(plain(xm), ym) * len(xm) / len(x)).backward()
        finally:
            torch.set_num_threads(threads)

    modes = [args.checkpoint] + (["never"] if args.checkpoint != "never" else [])
    t_seq = _median_seconds(sequential, 5)
    bound = args.stages * args.chunks / (args.chunks + args.stages - 1)
    print(f"step time, plain model on 1 thread, {args.chunks} micro-batches in turn: "
          f"{t_seq * 1e3:.0f} ms")
    for mode in modes:
        pipeline = pipe if mode == args.checkpoint else GPipe(
            copy.deepcopy(plain), balance, devices=["cpu"] * args.stages, chunks=args.chunks,
            checkpoint=mode)
        t_pipe = _median_seconds(pipelined(pipeline), 5)
        note = "" if mode == "never" else ", which recomputes a third more forward work"
        print(f"step time, GPipe on {args.stages} threads, checkpoint={mode!r}: "
              f"{t_pipe * 1e3:.0f} ms, speedup {t_seq / t_pipe:.2f}x{note}")
    print(f"(the bubble allows at most {bound:.2f}x on {args.stages} stages with "
          f"{args.chunks} micro-batches)")
    return 0
