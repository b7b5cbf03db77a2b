"""A vocabulary-parallel head under torchrun: every rank of the pipeline holds one shard
of the head (``conveyor.runtime.vocabulary``) and joins each micro-batch's loss.

The last stage's rank (the leader) computes a micro-batch's loss inside its ``F``; the
other ranks join it at the same place in the table's clock, before the first of their
own actions that comes after that ``F`` (:meth:`VocabRanks.joins`), so that every rank
runs the micro-batches' exchanges in one order and none waits for an action that waits
for it. One exchange, over a process group of the pipeline's ranks of its own (the
pipeline group carries the activations meanwhile), bounded like every collective::

    leader: [tokens, width, dtype] --broadcast--> every rank; hidden, targets likewise
    every rank r: z_r = hidden W_r^T
    all-reduce max of z_r (m), sum of exp(z_r - m) (s), the target's logit (t)
    loss = sum over tokens of log s + m - t          (the leader keeps it)
    every rank r: W_r.grad += p_r^T hidden,  p_r = softmax_r - onehot_r
    all-reduce of p_r W_r: the hidden states' gradient (the leader keeps it)

The backward is computed in the exchange, with each token weighing 1 (a ``(loss_sum,
count)`` loss, divided by the step's count with every other gradient): the leader's
backward hands on the gradient it kept. So a shard's logits live only during the
exchange, on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from conveyor.distributed.topology import Topology
from conveyor.errors import ConveyorError
from conveyor.runtime.vocabulary import VocabShards, accumulate_shard, shard_logits
from conveyor.schedules import Action, Kind, Schedule
from conveyor.schedules.clock import clock_order
from conveyor.tensor.crossentropy import exp_sum, logit_grad, target_logit, token_losses


__all__: list[str] = []

#: dtypes a hidden state may cross in, by their code in the exchange's header.
_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def refuse_across_processes(topology: Topology, *, sharding: str, precision: str | None,
                            rebalance: Any) -> None:
    """Raises ConveyorError for what a vocabulary-parallel head does not take under
    torchrun: replicated stages, FSDP, float16 loss scaling, re-balancing."""
    refused = {"data_parallel with replicas per stage": topology.replicas is not None,
               'sharding="fsdp"': sharding != "replicate",
               'precision="fp16" (loss scaling)': precision == "fp16",
               "rebalance=": rebalance is not None}
    named = [name for name, given in refused.items() if given]
    if named:
        raise ConveyorError(f"VocabParallelCrossEntropy under torchrun does not take "
                            f"{', '.join(named)}; leave it out, or use a plain loss_fn")


class VocabRanks:
    """This rank's part in the exchanges of a vocabulary-parallel head under torchrun.

    Args:
        runtime: the pipeline's ``Runtime`` (its schedule, topology, device and bounded
            collectives: ``broadcast``, ``all_reduce``).
        shards: the head's shards; this process holds its own rank's.
        group: the process group of the pipeline's ranks, for the exchanges alone.
    """

    def __init__(self, runtime: Any, shards: VocabShards, group: Any) -> None:
        self.runtime = runtime
        self.shards = shards
        self.group = group
        self.leader = runtime.schedule.stage_ranks[-1]

    def lead(self, hidden: torch.Tensor, targets: torch.Tensor,
             valid: torch.Tensor) -> torch.Tensor:
        """The leader's loss of one micro-batch (summed over tokens), whose backward
        hands on the gradient the exchange computed."""
        return _Exchanged.apply(hidden, targets, valid, self)

    def follow(self) -> None:
        """A follower's part in the next micro-batch's exchange."""
        self.exchange(None, None, None)

    def exchange(self, hidden: torch.Tensor | None, targets: torch.Tensor | None,
                 valid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """One micro-batch's exchange (the leader gives ``hidden``, ``targets`` and
        ``valid``): the summed loss, and the hidden states' gradient (tokens x width)."""
        device = self.runtime.device
        header = torch.zeros(3, dtype=torch.int64, device=device)
        if hidden is not None:
            header.copy_(torch.tensor([hidden.shape[0], hidden.shape[1],
                                       _DTYPES.index(hidden.dtype)]))
        self._broadcast(header, "the shape of the hidden states")
        tokens, width, code = (int(v) for v in header.tolist())
        flat = self._shared(hidden, (tokens, width), _DTYPES[code], "the hidden states")
        targets = self._shared(targets, (tokens,), torch.int64, "the targets")
        valid = self._shared(valid, (tokens,), torch.bool, "the targets' mask")
        (w, b, lo, hi), = self.shards.parts()
        z = shard_logits(flat, w, b)
        top = self._reduced(z.amax(dim=1), torch.distributed.ReduceOp.MAX, "the logits' max")
        total = self._reduced(exp_sum(z, top), None, "the softmax's sum")
        picked = self._reduced(target_logit(z, targets, lo, hi), None, "the target logits")
        grad_z = logit_grad(z, top, total, targets, valid.to(z.dtype), lo, hi)
        del z
        grad = self._reduced(accumulate_shard(w, b, grad_z, flat), None,
                             "the hidden states' gradient")
        return token_losses(top, total, picked, valid).sum(), grad

    def joins(self, everyone: Mapping[int, Sequence[Action]],
              schedule: Schedule) -> dict[int, list[Callable[[], None]]]:
        """Where this follower joins each micro-batch's exchange: by position in its
        column (``everyone[rank]``; its length: after its last action), before the first
        of its actions that comes after the leader's ``F`` of that micro-batch on the
        table's clock."""
        rank = self.runtime.topology.table_rank
        if rank == self.leader:
            return {}
        last = schedule.num_stages - 1
        order = clock_order(everyone, schedule)
        mine = [a for r, a in order if r == rank]
        joins: dict[int, list[Callable[[], None]]] = {}
        done = 0  # of this rank's actions, those before the current one in the order
        for r, action in order:
            if r == rank:
                done += 1
            elif r == self.leader and action.kind is Kind.FORWARD and action.stage == last:
                joins.setdefault(min(done, len(mine)), []).append(self.follow)
        return joins

    def logits(self, hidden: torch.Tensor | None) -> torch.Tensor | None:
        """Inference: the whole head's logits of the leader's ``hidden`` (every rank
        calls it; the leader gets them, the others None)."""
        device = self.runtime.device
        header = torch.zeros(3, dtype=torch.int64, device=device)
        if hidden is not None:
            header.copy_(torch.tensor([hidden.numel() // hidden.shape[-1], hidden.shape[-1],
                                       _DTYPES.index(hidden.dtype)]))
        self._broadcast(header, "the shape of the hidden states")
        tokens, width, code = (int(v) for v in header.tolist())
        flat = self._shared(None if hidden is None else hidden.reshape(tokens, width),
                            (tokens, width), _DTYPES[code], "the hidden states")
        (w, b, lo, hi), = self.shards.parts()
        whole = torch.zeros(tokens, self.shards.bounds[-1], dtype=torch.promote_types(
            flat.dtype, w.dtype), device=device)
        with torch.no_grad():
            whole[:, lo:hi] = shard_logits(flat, w, b)
        whole = self._reduced(whole, None, "the head's logits")
        if hidden is None:
            return None
        return whole.reshape(*hidden.shape[:-1], -1).to(hidden.device)

    def _shared(self, value: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype,
                what: str) -> torch.Tensor:
        """``value`` as the leader has it, on every rank."""
        tensor = (value.reshape(shape).to(self.runtime.device, dtype) if value is not None
                  else torch.empty(shape, dtype=dtype, device=self.runtime.device))
        if tensor.dtype == torch.bool:  # gloo broadcasts no booleans
            shared = tensor.to(torch.uint8)
            self._broadcast(shared, what)
            return shared.bool()
        tensor = tensor.contiguous()
        self._broadcast(tensor, what)
        return tensor

    def _broadcast(self, tensor: torch.Tensor, what: str) -> None:
        self.runtime.broadcast(tensor, self.leader, self.group,
                               f"the vocabulary-parallel head's exchange of {what}")

    def _reduced(self, tensor: torch.Tensor, op: Any, what: str) -> torch.Tensor:
        tensor = tensor.to(self.runtime.device).contiguous()
        self.runtime.all_reduce(tensor, self.group,
                                f"the vocabulary-parallel head's exchange of {what}", op)
        return tensor


class _Exchanged(torch.autograd.Function):
    """The leader's loss of a micro-batch; its backward hands on the gradient that the
    exchange computed (for a gradient of 1: each token's loss weighs 1)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor,
                ranks: VocabRanks) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1])
        loss, grad = ranks.exchange(flat, targets, valid)
        ctx.grad = grad.to(hidden.device, hidden.dtype).reshape(hidden.shape)
        return loss.to(hidden.device)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        if float(grad) != 1.0:
            raise ConveyorError(
                "VocabParallelCrossEntropy under torchrun computes the gradient in the "
                f"forward for a loss that weighs 1, but its backward got {float(grad)}")
        return ctx.grad, None, None, None


def vocabulary_group(topology: Topology) -> Any:
    """A process group of this pipeline's ranks for the exchanges (every process makes
    every pipeline's, in one order, as torch.distributed wants)."""
    data = topology.data_size
    mine = None
    for d in range(data):
        group = topology.new_group([k * data + d for k in range(topology.pipeline_size)])
        if d == topology.data_rank:
            mine = group
    return mine
