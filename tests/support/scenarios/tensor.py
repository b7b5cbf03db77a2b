"""Multi-process scenarios of tensor parallelism inside the stages (see
tests/test_tensor_parallel.py): 2 stages x 2 tensor ranks, every rank comparing its
gradient shards with the plain model's on the whole batch, in float64."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import conveyor
from conveyor.errors import TensorParallelError
import conveyor.tensor
from conveyor.tensor.full import full_state_dict
from tests.support.scenarios import scenario
from tests.support.tensor_cases import (
    batch,
    difference,
    float64_norms,
    floor,
    hf_model,
    plain_grads,
    sharded_family,
    token_loss,
)

CHUNKS = 4


@scenario("tensor_parallel")
def tensor_parallel(rank: int, world: int, out_dir: Path) -> None:
    """Llama and Qwen3 (1F1B, zero-bubble; Qwen3 built on meta, read from weights=), a
    user's block with a dict plan on an nn.Sequential, a cut between a column- and a
    row-parallel layer, and a refusal at build time. Every tensor crossing a boundary
    that the tensor group holds alike crosses as pieces (however small: the threshold
    is lowered), so each exact gradient is also that of the pieces gathered."""
    conveyor.tensor.SLICED_FROM = 0
    results: dict[str, Any] = {}
    inputs, targets = batch()
    sample = {"input_ids": inputs["input_ids"][:2], "use_cache": False}
    for family in ("llama", "qwen3"):
        plain = hf_model(family)
        if family == "llama":  # float64 throughout: exact to 1e-10
            undo = float64_norms(family)
        else:  # its own float32 norms: exact to the plain model's own floor
            results[f"{family}-floor"] = floor(family, plain, inputs, targets,
                                               plain_grads(plain, inputs, targets))
        reference = plain_grads(plain, inputs, targets)
        for schedule in ("1f1b", "zero-bubble"):
            if family == "qwen3":
                with torch.device("meta"):
                    model = type(plain)(plain.config).double()
                weights: Any = plain.state_dict()
            else:
                model, weights = copy.deepcopy(plain), None
            pipe = conveyor.Pipeline(model, split_at=["model.layers.1"], sample=sample,
                                     chunks=CHUNKS, schedule=schedule, loss_fn=token_loss,
                                     tensor_parallel=2, tp_plan="auto", weights=weights,
                                     timeout=120)
            loss = pipe.step(inputs, targets)
            results[f"{family}-{schedule}-crossing"] = crossing(pipe)
            with torch.no_grad():
                total, count = token_loss(plain(**inputs), targets)
            results[f"{family}-{schedule}-loss"] = abs(float(loss) - float(total / count))
            results[f"{family}-{schedule}-recompute"] = pipe.recompute
            results[f"{family}-{schedule}"] = difference(pipe, reference)
            whole = full_state_dict(pipe)
            own = plain.state_dict()
            results[f"{family}-{schedule}-full"] = [
                len(whole), all(torch.equal(v, own[k]) for k, v in whole.items())]
        if family == "llama":
            undo()
    results["block"] = _block()
    results["sharded-cut"] = _sharded_cut()
    results["check"] = _checks()
    results["vocabulary"] = _vocabulary()
    results["lengths"] = _lengths()
    results["stage"] = rank // 2
    results["refused"] = _refused()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results))


class Block(nn.Module):
    """A user's residual MLP block, split by a dict plan."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.down(torch.tanh(self.up(x))))


def _block() -> list[Any]:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel

    torch.manual_seed(3)
    plain = nn.Sequential(Block(), Block(), Block(), nn.Linear(8, 6)).double()
    x = torch.randn(8, 8, dtype=torch.float64)
    y = torch.randn(8, 6, dtype=torch.float64)
    plain.zero_grad()
    F.mse_loss(plain(x), y).backward()
    reference = {n: p.grad.detach().clone() for n, p in plain.named_parameters()}
    plan = {"*.up": "colwise", "*.down": "rowwise", "3": ColwiseParallel(
        output_layouts=Replicate())}
    pipe = conveyor.Pipeline(copy.deepcopy(plain), balance=[2, 2], chunks=CHUNKS,
                             schedule="1f1b", loss_fn=F.mse_loss, tensor_parallel=2,
                             tp_plan=plan, timeout=120)
    pipe.step(x, y)
    return list(difference(pipe, reference))


def _vocabulary() -> dict[str, Any]:
    """``loss_fn=VocabParallelCrossEntropy`` under tensor parallelism: the head split
    column-wise over the last stage's tensor group, its cross-entropy over the group's
    parts of the vocabulary (never gathered); untied under 1F1B, tied to the embedding
    of stage 0 under zero-bubble. Each: [loss gap, worst gradient, gradients compared,
    the largest gap of eval_step's logits (None off the last stage)]."""
    inputs, targets = batch()
    sample = {"input_ids": inputs["input_ids"][:2], "use_cache": False}
    found: dict[str, Any] = {}
    undo = float64_norms("llama")
    try:
        for tied, schedule in ((False, "1f1b"), (True, "zero-bubble")):
            plain = hf_model("llama", tie_word_embeddings=tied)
            reference = plain_grads(plain, inputs, targets)
            if tied:  # the head's copy of the tied weight, on the last stage
                reference["lm_head.weight"] = reference["model.embed_tokens.weight"]
            pipe = conveyor.Pipeline(copy.deepcopy(plain), split_at=["model.layers.1"],
                                     sample=sample, chunks=CHUNKS, schedule=schedule,
                                     loss_fn=conveyor.VocabParallelCrossEntropy("lm_head"),
                                     tensor_parallel=2, tp_plan="auto", timeout=120)
            loss = pipe.step(inputs, targets)
            with torch.no_grad():
                total, count = token_loss(plain(**inputs), targets)
                output = pipe.eval_step(inputs)
                logits = None if output is None else float(
                    (output.logits - plain(**inputs).logits).abs().max())
            found[f"{'tied' if tied else 'untied'}-{schedule}"] = [
                abs(float(loss) - float(total / count)), *difference(pipe, reference), logits]
    finally:
        undo()
    return found


def _lengths() -> list[Any]:
    """Micro-batches of their own lengths (5, 11, 7 and 3 tokens, 3, 1, 2 and 2
    sequences) given to a Llama split over 2 tensor ranks, every boundary crossing as
    pieces: [the loss's gap, the worst gradient difference, how many] against the plain
    model's token mean over all of them."""
    generator = torch.Generator().manual_seed(5)
    pairs = [(torch.randint(0, 64, (rows, length), generator=generator),
              torch.randint(0, 64, (rows, length), generator=generator))
             for rows, length in ((3, 5), (1, 11), (2, 7), (2, 3))]
    undo = float64_norms("llama")
    try:
        plain = hf_model("llama")
        sums = [token_loss(plain(input_ids=x, use_cache=False), y) for x, y in pairs]
        expected = sum(total for total, _ in sums) / sum(int(count) for _, count in sums)
        expected.backward()
        reference = {n: p.grad.detach().clone() for n, p in plain.named_parameters()}
        pipe = conveyor.Pipeline(
            copy.deepcopy(plain), split_at=["model.layers.1"], chunks=CHUNKS,
            sample={"input_ids": pairs[0][0][:1], "use_cache": False}, schedule="1f1b",
            loss_fn=token_loss, tensor_parallel=2, tp_plan="auto", timeout=120)
        loss = pipe.step(microbatches=[({"input_ids": x, "use_cache": False}, y)
                                       for x, y in pairs])
    finally:
        undo()
    return [abs(float(loss) - float(expected)), *difference(pipe, reference)]


def _checks() -> dict[str, Any]:
    """``conveyor.check`` of a pipeline split over tensor ranks, on every rank alike: a
    Llama (float64 norms) that matches; a softmax between a column-parallel layer and
    its row-parallel partner (it sees each rank's part of the features); and Qwen3
    without its q/k norms' gradients summed over the group. Each as
    [ok, setup, first finding's kind, its layer or name, its cause]."""
    from conveyor.tensor.plan import resolve_plan

    def said(report: Any) -> list[Any]:
        first = report.findings[0] if report.findings else None
        return [report.ok, report.setup, first and first.kind,
                first and (first.name or first.layer), first and first.cause]

    found: dict[str, Any] = {}
    inputs, targets = batch()
    llama = hf_model("llama")
    undo = float64_norms("llama")
    try:
        found["llama"] = said(conveyor.check(
            llama, inputs, targets, loss_fn=token_loss, stages=2, chunks=CHUNKS,
            split_at=["model.layers.1"], schedule="zero-bubble", tensor_parallel=2,
            tp_plan="auto"))
    finally:
        undo()
    torch.manual_seed(4)
    mixing = nn.Sequential(nn.Linear(8, 32), nn.Softmax(-1), nn.Linear(32, 8),
                           nn.Linear(8, 6)).double()
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    found["softmax"] = said(conveyor.check(
        mixing, x, y, loss_fn=F.mse_loss, balance=[2, 2], chunks=CHUNKS, schedule="1f1b",
        tensor_parallel=2, tp_plan={"0": "colwise", "2": "rowwise"}))
    qwen3 = hf_model("qwen3")
    unsummed = {k: v for k, v in resolve_plan(qwen3, "auto").items() if "_norm" not in k}
    found["qwen3-unsummed"] = said(conveyor.check(
        qwen3, inputs, targets, loss_fn=token_loss, stages=2, chunks=CHUNKS,
        split_at=["model.layers.1"], schedule="1f1b", tensor_parallel=2, tp_plan=unsummed))
    return found


def crossing(pipe: Any) -> dict[str, Any]:
    """What crossed between the stages: for each kind of message, the tensors the
    group held alike (by place) and the bytes this rank sent."""
    transport = pipe.runtime.transport
    return {"alike": {"-".join(map(str, key)): sorted(places)
                      for key, (_, places) in transport.boundary.alike.items()},
            "bytes": {"-".join(map(str, key)): flow.bytes
                      for key, flow in transport.traffic.flows.items()}}


def _sharded_cut() -> list[Any]:
    """A cut between a column- and a row-parallel layer: each tensor rank sends its own
    columns (held apart, so never cut into pieces), and the gradients stay exact."""
    torch.manual_seed(4)
    plain = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 8), nn.Linear(8, 6)).double()
    x = torch.randn(8, 8, dtype=torch.float64)
    y = torch.randn(8, 6, dtype=torch.float64)
    F.mse_loss(plain(x), y).backward()
    reference = {n: p.grad.detach().clone() for n, p in plain.named_parameters()}
    pipe = conveyor.Pipeline(copy.deepcopy(plain), balance=[2, 2], chunks=CHUNKS,
                             schedule="1f1b", loss_fn=F.mse_loss, tensor_parallel=2,
                             tp_plan={"0": "colwise", "2": "rowwise"}, timeout=120)
    pipe.step(x, y)
    return [*difference(pipe, reference), crossing(pipe)]


def _refused() -> str:
    """A tensor size that does not divide the model's heads, refused when built."""
    model = hf_model("llama", hidden_size=24, num_attention_heads=3, num_key_value_heads=3)
    inputs, _ = batch()
    try:
        conveyor.Pipeline(model, split_at=["model.layers.1"],
                          sample={"input_ids": inputs["input_ids"][:2], "use_cache": False},
                          chunks=CHUNKS, loss_fn=token_loss, tensor_parallel=2,
                          tp_plan="auto", timeout=120)
    except TensorParallelError as exc:
        return str(exc)
    return "not refused"


@scenario("tensor_mesh")
def tensor_mesh(rank: int, world: int, out_dir: Path) -> None:
    """8 processes: 2 stages x 2 replicas x 2 tensor ranks, a user's block with a dict
    plan, replicated and FSDP-sharded replicas, each on its half of the batch; Llama and
    Qwen3 by their own plans, FSDP-sharded, under 1F1B and zero-bubble."""
    torch.manual_seed(3)
    plain = nn.Sequential(Block(), Block(), Block(), nn.Linear(8, 6)).double()
    x = torch.randn(16, 8, dtype=torch.float64)
    y = torch.randn(16, 6, dtype=torch.float64)
    F.mse_loss(plain(x), y).backward()
    reference = {n: p.grad.detach().clone() for n, p in plain.named_parameters()}
    plan = {"*.up": "colwise", "*.down": "rowwise", "3": "colwise_gather_output"}
    results: dict[str, Any] = {}
    for sharding in ("replicate", "fsdp"):
        pipe = conveyor.Pipeline(copy.deepcopy(plain), balance=[2, 2], chunks=2,
                                 schedule="1f1b", loss_fn=F.mse_loss, data_parallel=2,
                                 tensor_parallel=2, tp_plan=plan, sharding=sharding,
                                 timeout=300)
        topology = pipe.topology
        half = slice(8 * topology.data_rank, 8 * topology.data_rank + 8)
        pipe.step(x[half], y[half])
        worst, count = 0.0, 0
        for name, param in pipe.named_parameters():
            grad = param.grad
            grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
            expected = reference[name]
            if grad.shape != expected.shape:  # this tensor rank's shard
                dim = next(i for i in range(grad.dim()) if grad.shape[i] != expected.shape[i])
                expected = expected.chunk(2, dim)[topology.tensor_rank]
            worst = max(worst, float((grad - expected).norm() / expected.norm()))
            count += 1
        results[sharding] = [worst, count, [topology.pipeline_rank, topology.data_rank,
                                            topology.tensor_rank]]
    for family in ("llama", "qwen3"):  # traced (split_at), FSDP beside the tensor ranks
        for schedule in ("1f1b", "zero-bubble"):
            results[f"{family}-{schedule}"] = sharded_family(family, schedule, 2)
    (out_dir / f"mesh{rank}.json").write_text(json.dumps(results))


#: name -> the Pipeline's options: the schedule families beyond 1F1B and zero-bubble,
#: on 4 stages of a 4-layer Llama over 2 pipeline ranks (two stages each) where they
#: take more stages than ranks, and recomputation's other modes.
SCHEDULES: dict[str, dict[str, Any]] = {
    "gpipe, recompute never": {"schedule": "gpipe", "recompute": "never", "stages": 2},
    "1f1b, recompute always": {"schedule": "1f1b", "recompute": "always", "stages": 2},
    "interleaved-1f1b": {"schedule": "interleaved-1f1b", "virtual_stages": 2, "stages": 4},
    "zb-v": {"schedule": "zb-v", "stages": 4},
    "v-half": {"schedule": "v-half", "stages": 4},
    "dualpipe-v": {"schedule": "dualpipe-v", "stages": 4},
}
#: The same on 6 processes: v-min needs 3 pipeline ranks or more (6 stages of a 6-layer
#: Llama, two on each).
SCHEDULES_ON_3 = {"v-min": {"schedule": "v-min", "stages": 6}}


@scenario("tensor_schedules")
def tensor_schedules(rank: int, world: int, out_dir: Path) -> None:
    """Every schedule family under 2 tensor ranks: a Llama of 4 layers, float64 norms,
    cut into 2 or 4 stages on 2 pipeline ranks, against the plain model's gradients;
    on 6 processes, v-min on 3 pipeline ranks (6 layers, 6 stages)."""
    chosen, layers = (SCHEDULES, 4) if world == 4 else (SCHEDULES_ON_3, 6)
    conveyor.tensor.SLICED_FROM = 0  # its boundaries cross as pieces
    inputs, targets = batch()
    sample = {"input_ids": inputs["input_ids"][:2], "use_cache": False}
    plain = hf_model("llama", num_hidden_layers=layers)
    undo = float64_norms("llama")
    reference = plain_grads(plain, inputs, targets)
    results: dict[str, Any] = {}
    for name, options in chosen.items():
        options = dict(options)
        stages = options.pop("stages")
        step = layers // stages
        cuts = [f"model.layers.{i}" for i in range(step, layers, step)]
        pipe = conveyor.Pipeline(copy.deepcopy(plain), split_at=cuts, sample=sample,
                                 chunks=CHUNKS, loss_fn=token_loss, tensor_parallel=2,
                                 tp_plan="auto", timeout=120, **options)
        loss = pipe.step(inputs, targets)
        with torch.no_grad():
            total, count = token_loss(plain(**inputs), targets)
        results[name] = [*difference(pipe, reference), abs(float(loss) - float(total / count)),
                         pipe.recompute]
    undo()
    (out_dir / f"schedules{rank}.json").write_text(json.dumps(results))


@scenario("tensor_frozen")
def tensor_frozen(rank: int, world: int, out_dir: Path) -> None:
    """2 tensor ranks, one stage; rank 1 freezes in its first layer's forward (before the
    row-parallel layer's all-reduce, which rank 0 then waits in, on its own thread). Rank
    0 writes what it raised and when; rank 1 wakes long after (and fails: its peer is
    gone)."""
    import time

    torch.manual_seed(0)
    net = nn.Sequential(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)),
                        nn.Linear(8, 8))
    if rank == 1:
        net[0][0].register_forward_hook(lambda *_: time.sleep(8))
    pipe = conveyor.Pipeline(net, loss_fn=F.mse_loss, tensor_parallel=2, chunks=2,
                             tp_plan={"0.0": "colwise", "0.2": "rowwise"}, timeout=3)
    start = time.monotonic()
    try:
        pipe.step(torch.randn(4, 8), torch.randn(4, 8))
    except Exception as exc:  # noqa: BLE001 - what it raised is the finding
        (out_dir / f"frozen{rank}.json").write_text(json.dumps(
            {"error": type(exc).__name__, "message": str(exc),
             "seconds": time.monotonic() - start}))
        raise
