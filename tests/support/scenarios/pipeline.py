"""Multi-process scenarios of conveyor.Pipeline: equivalence with the plain model, data
parallel, initialisation, clipping and a NaN, failures, checkpoints, models nobody here
wrote, ranks started with different options, and direct sends between stages.

Models and data come from tests.support.cases (and the other model modules of
tests.support), so the parent test builds exactly the same plain model and batch to
compare with.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import conveyor
from conveyor.engine.transport import emulated_links
from tests.support.cases import (
    MIXED,
    case_batch,
    case_model,
    cases,
    deep_mlp,
    nan_on_marker,
    padded_batch,
    token_loss,
)
from tests.support.scenarios import scenario


def _grads(pipe: conveyor.Pipeline) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in pipe.named_parameters() if p.grad is not None}


@scenario("equivalence")
def equivalence(rank: int, world: int, out_dir: Path) -> None:
    for model_name, schedule, virtual in cases(world):
        model, loss_fn = case_model(model_name)
        table = (conveyor.schedules.parse(MIXED, name="mixed") if schedule == "mixed"
                 else schedule)
        pipe = conveyor.Pipeline(model, chunks=4, schedule=table, virtual_stages=virtual,
                                 loss_fn=loss_fn, checkpoint="except_last", timeout=30)
        x, y = case_batch(model_name)
        loss = pipe.step(x, y)
        result = {"loss": loss, "grads": _grads(pipe), "eval": pipe.eval_step(x)}
        if model_name == "lm":  # a later batch of another sequence length
            pipe.zero_grad(set_to_none=True)
            x, y = case_batch(model_name, length=11, seed=2)
            result["loss_long"] = pipe.step(x, y)
            result["grads_long"] = _grads(pipe)
        torch.save(result, out_dir / f"{model_name}-{schedule}-{virtual}-rank{rank}.pt")


@scenario("data_parallel")
def data_parallel(rank: int, world: int, out_dir: Path) -> None:
    model, loss_fn = case_model("lm")
    pipe = conveyor.Pipeline(model, chunks=2, schedule="1f1b", data_parallel=2,
                             loss_fn=loss_fn, timeout=30)
    x, y = case_batch("lm", batch=12)
    replica = pipe.topology.data_rank
    loss = pipe.step(x[replica::2], y[replica::2])
    result = {"loss": loss, "grads": _grads(pipe)}
    # Then a token loss whose padding differs between the replicas (replica 1 holds the
    # more padded rows), its gradients added to the first step's.
    pipe.loss_fn = token_loss
    x, y = padded_batch(batch=12)
    result["token_loss"] = pipe.step(x[replica::2], y[replica::2])
    result["accumulated"] = _grads(pipe)
    torch.save(result, out_dir / f"rank{rank}.pt")


@scenario("ends_well")
def ends_well(rank: int, world: int, out_dir: Path) -> None:
    """A script's whole life, ending right after its last step (whose collectives gloo's
    threads free late): the process must exit 0, also pinned to one core."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(32)])
    pipe = conveyor.Pipeline(model, chunks=16, schedule="1f1b", recompute="never",
                             loss_fn=nn.functional.mse_loss)
    x, y = torch.randn(16, 16), torch.randn(16, 16)
    for _ in range(3):
        pipe.zero_grad(set_to_none=True)
        pipe.step(x, y)


@scenario("initialisation")
def initialisation(rank: int, world: int, out_dir: Path) -> None:
    with torch.device("meta"):
        meta_model = deep_mlp()
    torch.manual_seed(5)
    from_meta = conveyor.Pipeline(meta_model, chunks=2, loss_fn=nn.functional.mse_loss)
    torch.manual_seed(5)
    built = conveyor.Pipeline(lambda i: deep_mlp()[i], layers=12, chunks=2,
                              loss_fn=nn.functional.mse_loss)
    timed = conveyor.Pipeline(deep_mlp(), chunks=2, loss_fn=nn.functional.mse_loss,
                              balance="time", sample=torch.randn(4, 6, dtype=torch.float64))
    torch.save({"meta": from_meta.state_dict(), "builder": built.state_dict(),
                "timed": timed.balance}, out_dir / f"rank{rank}.pt")


@scenario("clip_and_check")
def clip_and_check(rank: int, world: int, out_dir: Path) -> None:
    model, loss_fn = case_model("lm")
    pipe = conveyor.Pipeline(model, chunks=4, schedule="1f1b", loss_fn=loss_fn,
                             check_finite=True, timeout=30)
    x, y = case_batch("lm")
    # Over emulated links of 0.1 s latency (a testing aid): the same gradients, later.
    with conveyor.record(pipe) as timeline, emulated_links(bandwidth=1e9, latency=0.1):
        start = time.monotonic()
        pipe.step(x, y)
        slowed = time.monotonic() - start
    norm = pipe.clip_grad_norm_(0.05)
    torch.save({"norm": norm, "grads": _grads(pipe), "timeline": timeline.to_dict(),
                "slowed": slowed, "fp16": fp16_overflow_on_rank_0(x.shape[0])},
               out_dir / f"rank{rank}.pt")
    pipe.zero_grad()
    bad = y.clone()
    bad[3, 0] = -1  # micro-batch 1 (samples 3-5) gets a NaN loss
    pipe.loss_fn = nan_on_marker(loss_fn)
    try:
        pipe.step(x, bad)
    except conveyor.ConveyorError:  # every rank: the NaN, or the news of it
        pipe.loss_fn = loss_fn  # skip the bad batch: the next step must be exact
        pipe.step(x, y)
        torch.save(_grads(pipe), out_dir / f"after{rank}.pt")
        raise


def fp16_overflow_on_rank_0(batch: int) -> dict[str, object]:
    """A float16 step whose gradients overflow on rank 0 alone: every rank must drop
    it. Returns what this rank saw: its Linear layers' output dtypes, and the step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                          nn.Linear(8, 2))
    dtypes = set()
    for layer in model:
        layer.register_forward_hook(lambda m, a, out: dtypes.add(str(out.dtype)))
    pipe = conveyor.Pipeline(model, chunks=2, schedule="1f1b", precision="fp16",
                             loss_fn=lambda out, y: nn.functional.mse_loss(out.float(), y),
                             timeout=30)
    if pipe.topology.pipeline_rank == 0:
        next(pipe.parameters()).register_hook(lambda g: g * float("inf"))
    x, y = torch.randn(batch, 4), torch.randn(batch, 2)
    pipe.step(x, y)
    assert pipe.scaler is not None
    return {"dtypes": sorted(dtypes), "found_inf": pipe.scaler.found_inf,
            "scale": pipe.scaler.scale,
            "grads": [p.grad is None for p in pipe.parameters()]}


class Fails(nn.Module):
    """Identity, except on rank ``fail_rank``: raises, or has the wrong width.

    With a ``marker`` (for "raise"), the failing rank creates that file just before it
    raises, and every other rank counts in ``after_failure`` the forwards it starts once
    the file exists. Rank 0, which receives no activations and so would run ahead, makes
    its 4th forward wait for the file and each later one last 0.2 s: time for the
    failure to reach it, so that a rank which never checks runs on and one which checks
    before each action stops within a forward or two (one per rank in between).
    """

    def __init__(self, how: str, fail_rank: int, marker: Path | None = None) -> None:
        super().__init__()
        self.how, self.fail_rank, self.marker = how, fail_rank, marker
        self.calls = 0
        self.after_failure = 0
        self.waited = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if conveyor.is_recomputing():
            return x
        rank = int(os.environ["RANK"])
        self.calls += 1
        if rank == self.fail_rank:
            if self.how == "raise" and self.calls == 3:
                if self.marker is not None:
                    self.marker.touch()
                raise ValueError("injected failure")
            if self.how == "shape":
                return x[:, :4]
        elif self.marker is not None:
            if rank == 0 and self.calls == 4:
                deadline = time.monotonic() + 30
                while not self.marker.exists() and time.monotonic() < deadline:
                    time.sleep(0.005)
                self.waited = self.marker.exists()
            if self.marker.exists():
                self.after_failure += 1
                if rank == 0:
                    time.sleep(0.2)
        return x


def _fault(how: str, rank: int, world: int, out_dir: Path | None = None) -> None:
    """Each stage is Linear, Linear, Fails; the last rank fails (for "shape": rank 0,
    whose output then reaches stage 1 two features short), under 1F1B with 4
    micro-batches. With ``out_dir`` (for "raise"), GPipe with 16 micro-batches instead,
    where rank 0 need not wait for the failing rank: each rank writes ``rank{r}.json``
    with its forwards, those started after the failure, and whether rank 0 waited for it.
    """
    fail_rank = 0 if how == "shape" else world - 1
    marker = None if out_dir is None else out_dir / "failed"
    layers: list[nn.Module] = []
    for _ in range(world):
        layers += [nn.Linear(6, 6), nn.Linear(6, 6), Fails(how, fail_rank, marker)]
    chunks = 4 if out_dir is None else 16
    pipe = conveyor.Pipeline(nn.Sequential(*layers), chunks=chunks,
                             schedule="1f1b" if out_dir is None else "gpipe",
                             balance=[3] * world, loss_fn=nn.functional.mse_loss,
                             timeout=15)
    try:
        pipe.step(torch.randn(2 * chunks, 6), torch.randn(2 * chunks, 6))
    finally:
        if out_dir is not None:
            fails = [m for m in pipe.modules() if isinstance(m, Fails) and m.calls]
            counts = {"forwards": sum(m.calls for m in fails),
                      "after_failure": sum(m.after_failure for m in fails),
                      "waited": any(m.waited for m in fails)}
            (out_dir / f"rank{rank}.json").write_text(json.dumps(counts))


@scenario("fault_raise")
def fault_raise(rank: int, world: int, out_dir: Path) -> None:
    _fault("raise", rank, world, out_dir)


@scenario("fault_shape")
def fault_shape(rank: int, world: int, out_dir: Path) -> None:
    _fault("shape", rank, world)


@scenario("checkpoint_crash")
def checkpoint_crash(rank: int, world: int, out_dir: Path) -> None:
    """Saves with torch.distributed.checkpoint, crashes in the next save, loads again."""
    import torch.distributed.checkpoint as dcp

    from conveyor.train import saving

    model, loss_fn = case_model("lm")
    pipe = conveyor.Pipeline(model, chunks=2, loss_fn=loss_fn, timeout=30)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=0.1)
    x, y = case_batch("lm")
    pipe.step(x, y)
    optimizer.step()
    saving.save(out_dir / "run", model=pipe, optimizer=optimizer, extra={"step": 1})
    saved = {k: v.clone() for k, v in pipe.state_dict().items()}

    pipe.step(x, y)
    optimizer.step()
    real_save = dcp.save

    def crash_after_some_files(state: Any, *, checkpoint_id: str) -> None:
        real_save({"model": state["model"]}, checkpoint_id=checkpoint_id)  # some of it
        raise OSError("killed while writing")

    dcp.save = crash_after_some_files
    try:
        saving.save(out_dir / "run", model=pipe, optimizer=optimizer, extra={"step": 2})
    except OSError:
        pass
    dcp.save = real_save

    extra = saving.load(out_dir / "run", model=pipe, optimizer=optimizer)
    torch.save({"step": extra["step"], "saved": saved, "loaded": pipe.state_dict(),
                "optimizer_steps": [float(s["step"]) for s in optimizer.state.values()]},
               out_dir / f"rank{rank}.pt")


@scenario("any_model")
def any_model(rank: int, world: int, out_dir: Path) -> None:
    """Models nobody here wrote, as constructed, split over the ranks: each model built
    whole on every rank (the same weights), then GPT-2 built on the meta device with
    weights read from a file, Llama on the meta device initialised by its own
    initialiser, and an nn.Sequential whose skip connection crosses the ranks."""
    from tests.support.any_models import (
        ANY_MODEL_CASES,
        ANY_MODEL_SPLITS,
        CHUNKS,
        build,
        gpt2,
        llama,
        loss_of,
        sample_of,
    )
    from tests.support.skip_models import long_skip

    for name, schedule, split_at, virtual in ANY_MODEL_CASES:
        model, _, _, inputs, targets = build(name)
        pipe = conveyor.Pipeline(model, split_at=split_at, sample=sample_of(inputs),
                                 chunks=CHUNKS, schedule=schedule, virtual_stages=virtual,
                                 loss_fn=loss_of(name), timeout=60)
        loss = pipe.step(inputs, targets)
        torch.save({"loss": loss, "grads": _grads(pipe), "state": list(pipe.state_dict())},
                   out_dir / f"{name}-{schedule}-rank{rank}.pt")
    model, _, inputs, targets = gpt2()
    with torch.device("meta"):
        meta = type(model)(model.config).double()
    pipe = conveyor.Pipeline(meta, split_at=ANY_MODEL_SPLITS["gpt2"], sample=sample_of(inputs),
                             chunks=CHUNKS, schedule="1f1b", loss_fn=loss_of("gpt2"),
                             weights=out_dir / "gpt2.safetensors", timeout=60)
    loss = pipe.step(inputs, targets)
    torch.save({"loss": loss, "grads": _grads(pipe), "state": pipe.state_dict()},
               out_dir / f"gpt2-meta-rank{rank}.pt")
    model, _, inputs, _ = llama()
    with torch.device("meta"):
        meta = type(model)(model.config)
    torch.manual_seed(5)
    pipe = conveyor.Pipeline(meta, split_at=ANY_MODEL_SPLITS["llama"], sample=sample_of(inputs),
                             chunks=CHUNKS, loss_fn=loss_of("llama"), timeout=60)
    torch.save(pipe.state_dict(), out_dir / f"llama-meta-rank{rank}.pt")
    model, _, inputs, targets = long_skip()  # an nn.Sequential whose skip crosses ranks
    pipe = conveyor.Pipeline(model, balance=[2, 3], chunks=CHUNKS, schedule="1f1b",
                             sample=inputs[:2].detach(), loss_fn=F.mse_loss, timeout=60)
    loss = pipe.step(inputs.detach(), targets)
    torch.save({"loss": loss, "grads": _grads(pipe)}, out_dir / f"skip-rank{rank}.pt")


@scenario("mismatch")
def mismatch(rank: int, world: int, out_dir: Path) -> None:
    """Ranks started with different options: each refuses, then a matching pipeline runs."""
    messages = {}
    mismatched: dict[str, dict[str, Any]] = {
        "balance": {"balance": [[3, 3], [2, 4]][rank]},
        "chunks": {"chunks": 2 + 2 * rank},
        "schedule": {"schedule": ["gpipe", "1f1b"][rank]},
    }
    for name, options in mismatched.items():
        try:
            conveyor.Pipeline(deep_mlp(6), loss_fn=F.mse_loss, **{"chunks": 2, **options},
                              timeout=30)
        except conveyor.ConfigError as exc:
            messages[name] = str(exc)
    try:
        conveyor.Pipeline(deep_mlp(6 + 2 * rank), loss_fn=F.mse_loss, chunks=2, timeout=30)
    except conveyor.ConfigError as exc:
        messages["model"] = str(exc)
    pipe = conveyor.Pipeline(deep_mlp(6), loss_fn=F.mse_loss, chunks=2, timeout=30)
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    messages["loss"] = str(pipe.step(x, y).item())
    (out_dir / f"rank{rank}.json").write_text(json.dumps(messages))


@scenario("direct_edges")
def direct_edges(rank: int, world: int, out_dir: Path) -> None:
    """A traced model over processes (split_at under torchrun), each rank building its
    own stage from the whole model's trace: first a context used by stages 1 and 2 (edge
    0->2, its gradients summed on stage 0), then a mask used by stage 2 alone (edge 0~>2,
    no gradient comes back)."""
    from tests.support.crossing_models import crossing

    runs = [("context", (1, 2), (), "1f1b", "except_last"),
            ("context", (1, 2), (), "zero-bubble", "always"),
            ("mask", (), (2,), "gpipe", "never")]
    for case, context_at, mask_at, schedule, checkpoint in runs:
        model = crossing(world, context_at=context_at, mask_at=mask_at)
        result = _traced_step(model, schedule, checkpoint, rank, world)
        torch.save(result, out_dir / f"{case}-{schedule}-rank{rank}.pt")


def _traced_step(model: nn.Module, schedule_name: str, checkpoint: str, rank: int,
                 world: int, chunks: int = 4) -> dict[str, Any]:
    """One training step of ``model`` (a tests.support.crossing_models.Crossing) cut into ``world``
    stages under torchrun, this rank's stage alone; its gradients and what its
    transport sent."""
    from conveyor.engine.microbatch import split
    from tests.support.crossing_models import token_batch, token_loss

    ids, targets = token_batch()
    pipe = conveyor.Pipeline(model, split_at=model.split_at(), sample=split(ids, chunks)[0],
                             chunks=chunks, schedule=schedule_name, checkpoint=checkpoint,
                             loss_fn=token_loss, timeout=30)
    pipe.runtime.transport.traffic.clear()
    pipe.step(ids, targets)
    return {"edges": [str(e) for e in pipe.schedule.edges],
            "grads": {n: p.grad for n, p in pipe.named_parameters() if p.grad is not None},
            "traffic": {key: (f.messages, f.bytes, f.wire)
                        for key, f in pipe.runtime.transport.traffic.flows.items()}}


class _RaisesInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise ValueError("once, in backward")


class FailsOnce(nn.Module):
    """Raises on the first call while ``armed`` holds (in forward, or in its backward);
    then computes as Linear. ``armed`` is the test's switch, shared by every stage's
    layers: declared harmless, as a user declares state a forward may change."""

    conveyor_harmless = ("armed",)

    def __init__(self, armed: list[bool], where: str) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)
        self.armed = armed
        self.where = where

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed[0]:
            self.armed[0] = False
            if self.where == "forward":
                raise ValueError("once")
            return _RaisesInBackward.apply(self.linear(x))
        return self.linear(x)


@scenario("pipeline_after_failure")
def pipeline_after_failure(rank: int, world: int, out_dir: Path) -> None:
    """A step fails, in turn: in the forward of the first rank ("forward0") or of the
    last ("forward"), in the last rank's backward, in its loss, and with a tied weight;
    each time the same pipeline takes its next step, then a new Pipeline on the same
    process group takes two. Each rank writes ``rank{r}.json``: per failure, per
    attempt and step, the loss or the error."""
    outcome: dict[str, dict[str, Any]] = {}
    for how in ("forward0", "forward", "backward", "loss", "tied"):
        armed = [rank == (0 if how == "forward0" else world - 1) and how != "loss"]
        failing_loss = [how == "loss" and rank == world - 1]

        def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            if failing_loss[0]:
                failing_loss[0] = False
                raise ValueError("once, in the loss")
            return nn.functional.mse_loss(output, target)

        outcome[how] = {}
        for attempt in range(2):
            torch.manual_seed(0)
            layers: list[nn.Module] = []
            for _ in range(world):
                layers += [nn.Linear(6, 6), FailsOnce(armed, "backward" if how == "backward"
                                                      else "forward")]
            if how == "tied":
                layers[-1].linear.weight = layers[0].weight
            pipe = conveyor.Pipeline(nn.Sequential(*layers), chunks=4, schedule="1f1b",
                                     balance=[2] * world, loss_fn=loss_fn, timeout=15)
            for step in range(2):
                try:
                    loss = pipe.step(torch.randn(8, 6), torch.randn(8, 6))
                    outcome[how][f"{attempt}.{step}"] = float(loss)
                except conveyor.ConveyorError as exc:
                    outcome[how][f"{attempt}.{step}"] = \
                        f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    (out_dir / f"rank{rank}.json").write_text(json.dumps(outcome))
