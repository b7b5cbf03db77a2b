"""Multi-process scenarios of FSDP (see tests/test_fsdp.py): 2 stages x 2 shards,
compared by the parent with the plain model on the global batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import conveyor
from conveyor.torchprivate import fsdp_params
from conveyor.train import saving
from tests.support.cases import (
    case_batch,
    case_model,
    nan_on_marker,
    padded_batch,
    token_loss,
)
from tests.support.scenarios import scenario
from tests.support.tensor_cases import sharded_family

BATCH = 12
CLIP = 0.05
LR = 1e-2


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (a collective of its mesh), or the tensor."""
    full = getattr(tensor, "full_tensor", None)
    return (full() if full is not None else tensor).detach().clone()


def _grads(pipe: conveyor.Pipeline) -> dict[str, torch.Tensor]:
    return {n: _full(p.grad) for n, p in pipe.named_parameters() if p.grad is not None}


def _params(pipe: conveyor.Pipeline) -> dict[str, torch.Tensor]:
    return {n: _full(p) for n, p in pipe.named_parameters()}


def _moments(pipe: conveyor.Pipeline, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return {n: _full(optimizer.state[p]["exp_avg"]) for n, p in pipe.named_parameters()
            if p in optimizer.state}


def _gathered(pipe: conveyor.Pipeline) -> int:
    """How many of FSDP's gathered parameters hold storage (between steps: none)."""
    from torch.distributed.fsdp import FSDPModule

    return sum(1 for module in pipe.modules() if isinstance(module, FSDPModule)
               for param in fsdp_params(module)
               if getattr(param, "_unsharded_param", None) is not None
               and param._unsharded_param.untyped_storage().nbytes() > 0)


def _unsharded_grads(pipe: conveyor.Pipeline) -> int:
    """How many of FSDP's gathered parameters hold a gradient (between steps: none)."""
    from torch.distributed.fsdp import FSDPModule

    return sum(1 for module in pipe.modules() if isinstance(module, FSDPModule)
               for param in fsdp_params(module)
               if getattr(param, "_unsharded_param", None) is not None
               and param._unsharded_param.grad is not None)


#: What FSDP2 calls for each, by torch's name for it: the first that this torch has
#: (2.13: the ``_single`` ones; 2.11 has only the ``_tensor`` ones).
_FSDP_COLLECTIVES = {"all_gather_single": ("all_gather_single", "all_gather_into_tensor"),
                     "reduce_scatter_single": ("reduce_scatter_single",
                                               "reduce_scatter_tensor")}


class _Counted:
    """Counts FSDP's all-gathers and reduce-scatters while entered."""

    def __init__(self) -> None:
        self.calls = dict.fromkeys(_FSDP_COLLECTIVES, 0)
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> _Counted:
        for counted, names in _FSDP_COLLECTIVES.items():
            name = next(name for name in names if hasattr(dist, name))
            original = self._saved[name] = getattr(dist, name)

            def counting(*args: Any, _counted: str = counted, _original: Any = original,
                         **kwargs: Any) -> Any:
                self.calls[_counted] += 1
                return _original(*args, **kwargs)
            setattr(dist, name, counting)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)


def _local_fraction(pipe: conveyor.Pipeline) -> float:
    """This rank's share of its stages' parameter elements (1/D when sharded)."""
    local = sum(getattr(p, "to_local", lambda p=p: p)().numel() for p in pipe.parameters())
    return local / sum(p.numel() for p in pipe.parameters())


@scenario("fsdp")
def fsdp(rank: int, world: int, out_dir: Path) -> None:
    """Equivalence under five schedules (the split backwards of zero-bubble and zb-v
    among them), accumulation of a token loss, clipping, AdamW, a checkpoint, then a
    NaN loss on every replica."""
    result: dict[str, Any] = {}
    for name, schedule, virtual, checkpoint in (("mlp", "gpipe", 1, "always"),
                                                ("mlp", "interleaved-1f1b", 2, "except_last"),
                                                ("mlp", "zero-bubble", 1, "except_last"),
                                                ("mlp", "zb-v", 1, "never")):
        model, loss_fn = case_model(name)
        pipe = conveyor.Pipeline(model, chunks=2, schedule=schedule, virtual_stages=virtual,
                                 checkpoint=checkpoint, data_parallel=2, sharding="fsdp",
                                 loss_fn=loss_fn, timeout=30)
        replica = pipe.topology.data_rank
        x, y = case_batch(name, batch=BATCH)
        with _Counted() as counted:
            result[f"{schedule}-loss"] = pipe.step(x[replica::2], y[replica::2])
        result[f"{schedule}-grads"] = _grads(pipe)
        result[f"{schedule}-eval"] = pipe.eval_step(x[replica::2])
        result[f"{schedule}-gathered"] = _gathered(pipe)  # after eval_step: none
        result[f"{schedule}-collectives"] = dict(counted.calls, units=sum(
            1 for stage in pipe.runtime.stages.values() for layer in stage.layers
            if any(True for _ in layer.parameters())))
    model, loss_fn = case_model("lm")  # tied embedding and head
    pipe = conveyor.Pipeline(model, chunks=2, schedule="1f1b", data_parallel=2,
                             sharding="fsdp", loss_fn=loss_fn, check_finite=True, timeout=30)
    replica = pipe.topology.data_rank
    result["fraction"] = _local_fraction(pipe)
    x, y = case_batch("lm", batch=BATCH)
    result["loss"] = pipe.step(x[replica::2], y[replica::2])
    result["grads"] = _grads(pipe)
    pipe.loss_fn = token_loss  # replica 1 holds the more padded rows: counts differ
    tx, ty = padded_batch(batch=BATCH)
    result["token_loss"] = pipe.step(tx[replica::2], ty[replica::2])
    result["accumulated"] = _grads(pipe)
    result["norm"] = pipe.clip_grad_norm_(CLIP)
    result["clipped"] = _grads(pipe)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=LR)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    result["stepped"] = _params(pipe)
    result["moments"] = _moments(pipe, optimizer)
    saving.save(out_dir / "run", model=pipe, optimizer=optimizer, extra={"step": 1})
    pipe.save_pretrained(out_dir / "exported")  # each stage's shards gathered, written once
    pipe.loss_fn = nan_on_marker(loss_fn)
    bad = y.clone()
    bad[6:8, 0] = -1  # a NaN loss in micro-batch 1 of both replicas, after 1B0
    try:
        pipe.step(x[replica::2], bad[replica::2])
    except (conveyor.NonFiniteLossError, conveyor.StageError) as exc:
        result["nan"] = f"{type(exc).__name__}: {exc}"
    # A failed step leaves the weights sharded and no gradient behind (a pipeline does
    # not step again after a failure: its transport keeps the peer's report).
    result["after_nan"] = {n: (type(p).__name__, p.grad is None)
                           for n, p in pipe.named_parameters()}
    result["unsharded_grads"] = _unsharded_grads(pipe)
    try:  # a traced model whose embedding and head are tied: refused on every rank
        conveyor.Pipeline(case_model("lm")[0], split_at=["3"], sample=x[:3], chunks=2,
                          data_parallel=2, sharding="fsdp", loss_fn=loss_fn, timeout=30)
    except conveyor.ModelError as exc:
        result["traced"] = str(exc)
    # A traced Llama (split_at): each module its graph reads is a unit of its own.
    result["traced-llama"] = sharded_family("llama", "zero-bubble")
    result["nan_gradient"] = _nan_gradient_in_one_shard()
    result["fp16_overflow"] = _fp16_overflow_in_one_shard()
    torch.save(result, out_dir / f"rank{rank}.pt")


class _PoisonedGradient(torch.nn.Module):
    """The identity; in backward, where ``poisoned`` (this process), the gradient's
    column 5 is ``value`` (NaN): so is row 5 alone of the weight gradient of the Linear
    before it, which the replicas' reduce-scatter leaves in the shard of one of them."""

    poisoned = False
    value = float("nan")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.poisoned and x.requires_grad:
            x.register_hook(lambda g: g.index_fill(1, torch.tensor([5]), self.value))
        return x


def _poisonable_pipeline(**options: Any) -> conveyor.Pipeline:
    """2 stages x 2 FSDP replicas of three Linear(6, 6), a :class:`_PoisonedGradient`
    after the first."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), _PoisonedGradient(),
                                torch.nn.Linear(6, 6), torch.nn.Linear(6, 6))
    return conveyor.Pipeline(model, chunks=2, schedule="1f1b", data_parallel=2,
                             sharding="fsdp", recompute="never", balance=[2, 2],
                             loss_fn=torch.nn.functional.mse_loss, timeout=30, **options)


def _nan_gradient_in_one_shard() -> str:
    """A finite loss whose gradients are NaN in one shard of stage 0 (replica 0's batch
    puts it in replica 1's rows): what each rank raises."""
    pipe = _poisonable_pipeline()
    _PoisonedGradient.poisoned = pipe.topology.data_rank == 0
    try:
        pipe.step(torch.randn(4, 6), torch.randn(4, 6))
    except conveyor.NonFiniteGradientError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _fp16_overflow_in_one_shard() -> dict[str, Any]:
    """float16 loss scaling: a step whose gradients are finite keeps the scale; one
    whose gradients are infinite in one shard of stage 0 only (as above) is dropped on
    every rank, the scale halved, ``.grad`` left as it was."""
    pipe = _poisonable_pipeline(precision="fp16")
    assert pipe.scaler is not None
    x, y = torch.randn(4, 6), torch.randn(4, 6)
    _PoisonedGradient.poisoned = False
    pipe.step(x, y)
    kept = {"found_inf": pipe.scaler.found_inf, "scale": pipe.scaler.scale}
    pipe.zero_grad(set_to_none=True)
    _PoisonedGradient.poisoned, _PoisonedGradient.value = pipe.topology.data_rank == 0, \
        float("inf")
    pipe.step(x, y)
    _PoisonedGradient.poisoned, _PoisonedGradient.value = False, float("nan")
    return {"kept": kept, "found_inf": pipe.scaler.found_inf, "scale": pipe.scaler.scale,
            "grads_none": all(p.grad is None for p in pipe.parameters())}


@scenario("fsdp_resume")
def fsdp_resume(rank: int, world: int, out_dir: Path) -> None:
    """The checkpoint of :func:`fsdp` (2 x 2 shards) loaded by 2 stages x 1,
    sharded and replicated."""
    result: dict[str, Any] = {}
    for sharding in ("fsdp", "replicate"):
        model, loss_fn = case_model("lm")
        pipe = conveyor.Pipeline(model, chunks=2, schedule="1f1b", sharding=sharding,
                                 loss_fn=loss_fn, timeout=30)
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=LR)
        extra = saving.load(out_dir / "run", model=pipe, optimizer=optimizer)
        result[sharding] = {"step": extra["step"], "params": _params(pipe),
                            "moments": _moments(pipe, optimizer)}
    torch.save(result, out_dir / f"resume-rank{rank}.pt")
