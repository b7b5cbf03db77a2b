"""A vocabulary-parallel last stage: the output head and its cross-entropy split by
vocabulary over every pipeline rank (Vocabulary Parallelism, Yeung et al., 2024).

A language model's head, a linear layer into a vocabulary V much wider than the model,
makes the last stage the heaviest: its weight (V x H), its logits (tokens x V) and their
softmax live there. ``loss_fn=conveyor.VocabParallelCrossEntropy("lm_head")`` takes the
head out of the model (the last stage hands on the hidden states, the head's input)
and gives each of the K ranks' devices rows ``V*r/K .. V*(r+1)/K`` of its weight. The
loss of a micro-batch, at the last stage, then runs on every shard's device::

    hidden (last stage) --> each shard r: z_r = hidden W_r^T, its maxima
    max over shards m, sum over shards of exp(z_r - m) s  -->  loss = log s + m - z[target]
    backward, each shard r: p_r = exp(z_r - m)/s - onehot_r   W_r.grad += p_r^T hidden
                            hidden.grad = sum over shards of p_r W_r

which is the cross-entropy of the whole head, exactly (its ``(loss_sum, count)``: the
mean over every token that is not ``ignore_index`` of the whole batch). A shard's
logits stay on its device between the micro-batch's forward and backward, so the last
stage holds no V-wide tensor; a shard's weight gradient is added to ``.grad`` in the
backward (a split backward's ``I``, as a compiled graph's). On CUDA the shards' kernels
queue on their devices' streams at once.

The pipeline registers the shards as ``pipe.vocab_shards`` (what the optimizer steps,
``weights[str(rank)]``); in one process its ``state_dict`` holds the head's weight whole
under its own name, as the plain model's does, and ``load_state_dict`` cuts it again.
Inference (``pipe(x)``, ``eval_step``) returns the whole logits in the head's place.
Under torchrun each rank holds its own shard, and the ranks join each micro-batch's
loss in one exchange of collectives (``conveyor.runtime.vocabranks``).

With ``tensor_parallel=T`` the head is not taken out: it is split column-wise over the
last stage's tensor group instead (:meth:`VocabParallelCrossEntropy.split_over`), each
rank's logits its part of the vocabulary, and the loss is
:func:`conveyor.tensor.crossentropy.parallel_cross_entropy` over the group. Both ways
share the cross-entropy's arithmetic, which lives in :mod:`conveyor.tensor.crossentropy`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from conveyor.errors import ConveyorError
from conveyor.tensor import regions
from conveyor.tensor.apply import Group
from conveyor.tensor.crossentropy import (
    exp_sum,
    logit_grad,
    parallel_cross_entropy,
    target_logit,
    token_losses,
)

__all__ = ["VocabParallelCrossEntropy"]


class VocabParallelCrossEntropy:
    """``loss_fn=``: the cross-entropy of the model's head ``head`` (an ``nn.Linear``
    into the vocabulary), split over the pipeline's ranks (a head not tied to another
    weight), or with ``tensor_parallel`` over the last stage's tensor group (tied or
    not).

    Args:
        head: the head's module name in the model (``"lm_head"``).
        ignore_index: a target that counts for nothing (padding).

    Returns ``(loss_sum, count)`` per micro-batch, as ``conveyor.token_loss`` does: the
    step's loss is the mean over the batch's tokens.
    """

    def __init__(self, head: str = "lm_head", *, ignore_index: int = -100) -> None:
        self.head = head
        self.ignore_index = ignore_index
        self.shards: VocabShards | None = None
        #: under torchrun, the loss over every rank's shard (``vocabranks``), else None
        self.exchange: Callable[[torch.Tensor, torch.Tensor, torch.Tensor],
                                torch.Tensor] | None = None
        #: with tensor_parallel: the last stage's tensor group, over which the head is
        #: split column-wise (its logits by vocabulary), else None
        self.group: Group | None = None

    @property
    def recomputed_with_stage(self) -> bool:
        """Whether a recomputed last stage runs this loss again in its backward: with
        the head split over the pipeline's ranks it does not (its shards keep their
        logits on their own devices; under torchrun every rank joins each call), over a
        tensor group it does (every rank of the group runs the stage's actions alike).
        See ``conveyor.engine.actions.StageActions._loss``."""
        return self.group is not None

    def split_over(self, group: Group) -> None:
        """The head stays in the model, split column-wise over the last stage's tensor
        ``group``: each rank's logits are its part of the vocabulary."""
        self.group = group

    def whole_logits(self, output: Any) -> Any:
        """Inference over a tensor group: the last stage's ``output`` with the whole
        vocabulary's logits in place of this rank's part (a collective of the group)."""
        if self.group is None:
            return output
        g = self.group
        return replace_hidden(output, regions.tp_gather(hidden_of(output), g.name, g.seconds,
                                                       g.size, g.rank))

    def __repr__(self) -> str:
        return f"VocabParallelCrossEntropy({self.head!r}, ignore_index={self.ignore_index})"

    def __call__(self, output: Any, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.group is not None:  # this rank's logits: its part of the vocabulary
            logits = hidden_of(output)
            targets = targets.reshape(-1).to(logits.device)
            valid = targets != self.ignore_index
            return parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]), targets, valid,
                                          self.group), valid.sum()
        if self.shards is None:
            raise ConveyorError("VocabParallelCrossEntropy is a loss_fn of conveyor.Pipeline, "
                                "which gives it the head's shards; it was called outside one")
        hidden = hidden_of(output)
        targets = targets.reshape(-1).to(hidden.device)
        valid = targets != self.ignore_index
        if self.exchange is not None:  # under torchrun: with every rank's shard
            return self.exchange(hidden, targets, valid), valid.sum()
        return _CrossEntropy.apply(hidden, targets, valid, self.shards), valid.sum()


class VocabShards(nn.Module):
    """The head's weight (and bias) cut by rows into ``ranks`` shards, of which this
    process holds those of ``devices`` (pipeline rank: device; in one process every
    rank's, under torchrun its own), as ``weights[str(rank)]`` (``biases``)."""

    def __init__(self, head: nn.Linear, devices: Mapping[int, torch.device],
                 ranks: int) -> None:
        super().__init__()
        vocabulary = head.out_features
        if vocabulary < ranks:
            raise ConveyorError(f"the head has {vocabulary} outputs, fewer than the "
                                f"{ranks} ranks to split them over")
        self.bounds = [vocabulary * r // ranks for r in range(ranks + 1)]
        self.weights = nn.ParameterDict({
            str(r): _shard(head.weight, *self.rows(r), device) for r, device in devices.items()})
        self.biases = nn.ParameterDict({
            str(r): _shard(head.bias, *self.rows(r), device) for r, device in devices.items()
        }) if head.bias is not None else None

    def rows(self, rank: int) -> tuple[int, int]:
        """The rows ``lo .. hi - 1`` of rank ``rank``'s shard."""
        return self.bounds[rank], self.bounds[rank + 1]

    @property
    def whole_here(self) -> bool:
        """Whether this process holds every shard (one process)."""
        return len(self.weights) == len(self.bounds) - 1

    def parts(self) -> list[tuple[nn.Parameter, nn.Parameter | None, int, int]]:
        """Per shard held here, by rank: its weight, bias (or None) and rows."""
        return [(w, None if self.biases is None else self.biases[r], *self.rows(int(r)))
                for r, w in self.weights.items()]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The whole head's output on ``hidden`` (inference), on its device."""
        return torch.cat([nn.functional.linear(hidden.to(w.device), w, b).to(hidden.device)
                          for w, b, _, _ in self.parts()], dim=-1)

    def with_logits(self, output: Any) -> Any:
        """The last stage's output with the whole head's logits in the hidden states'
        place (inference, one process)."""
        return replace_hidden(output, self.logits(hidden_of(output)))

    def whole(self, name: str) -> torch.Tensor:
        """The head's ``name`` ("weight" or "bias") whole, on the CPU (one process)."""
        shards = getattr(self, SHARDED[name])
        return torch.cat([shard.detach().cpu() for shard in shards.values()])


#: The head's tensors, by the name of their shards in :class:`VocabShards`.
SHARDED = {"weight": "weights", "bias": "biases"}


def _shard(tensor: torch.Tensor, lo: int, hi: int, device: torch.device) -> nn.Parameter:
    return nn.Parameter(tensor.detach()[lo:hi].to(device, copy=True),
                        requires_grad=tensor.requires_grad)


class _CrossEntropy(torch.autograd.Function):
    """The summed cross-entropy of ``hidden`` through the shards, and its backward."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor,
                shards: VocabShards) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1])
        here = hidden.device
        logits = [shard_logits(flat, w, b) for w, b, _, _ in shards.parts()]
        top = torch.stack([z.amax(dim=1).to(here) for z in logits]).amax(dim=0)
        total = sum((exp_sum(z, top).to(here) for z in logits), torch.zeros_like(top))
        picked = sum((target_logit(z, targets, lo, hi).to(here)
                      for z, (_, _, lo, hi) in zip(logits, shards.parts())),
                     torch.zeros_like(top))
        ctx.shards = shards
        ctx.dtype, ctx.shape = hidden.dtype, hidden.shape
        ctx.save_for_backward(flat, targets, valid, top, total, *logits)
        return token_losses(top, total, picked, valid).sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        flat, targets, valid, top, total, *logits = ctx.saved_tensors
        weight = valid.to(top.dtype) * grad.to(top.dtype)  # each token's share of grad
        grad_flat = torch.zeros(flat.shape, dtype=top.dtype, device=flat.device)
        for z, (w, b, lo, hi) in zip(logits, ctx.shards.parts()):
            grad_z = logit_grad(z, top, total, targets, weight, lo, hi)
            grad_flat += accumulate_shard(w, b, grad_z, flat).to(flat.device)
        return grad_flat.to(ctx.dtype).reshape(ctx.shape), None, None, None


def shard_logits(flat: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """A shard's logits of ``flat`` (tokens x width), on the shard's device, in the
    wider of their dtypes and outside autocast: the softmax wants full precision."""
    dtype = torch.promote_types(flat.dtype, w.dtype)
    with torch.autocast(w.device.type, enabled=False):
        return nn.functional.linear(flat.to(w.device, dtype), w.to(dtype),
                                    None if b is None else b.to(dtype))


def accumulate_shard(w: nn.Parameter, b: nn.Parameter | None, grad_z: torch.Tensor,
                     flat: torch.Tensor) -> torch.Tensor:
    """Adds a shard's weight (and bias) gradient to ``.grad``; returns its part of the
    input's gradient, on the shard's device."""
    x = flat.to(grad_z.device, grad_z.dtype)
    _accumulate(w, grad_z.t() @ x)
    if b is not None:
        _accumulate(b, grad_z.sum(dim=0))
    return grad_z @ w.to(grad_z.dtype)


def _accumulate(param: nn.Parameter, grad: torch.Tensor) -> None:
    """Adds ``grad`` to ``param.grad``, as autograd's accumulation would."""
    if not param.requires_grad:
        return
    grad = grad.to(param.dtype)
    if param.grad is None:
        param.grad = grad
    else:
        param.grad += grad


def hidden_of(output: Any) -> torch.Tensor:
    """The head's input among the last stage's output: the output itself, its
    ``logits`` (a Hugging Face model's output, the head taken out) or its first element."""
    if isinstance(output, torch.Tensor):
        return output
    if hasattr(output, "logits"):
        return output.logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise ConveyorError(f"VocabParallelCrossEntropy found no hidden states in the last "
                        f"stage's output ({type(output).__name__}): return a tensor, a "
                        "tuple whose first element is one, or an object with .logits")


def replace_hidden(output: Any, logits: torch.Tensor) -> Any:
    """The last stage's ``output`` with ``logits`` where :func:`hidden_of` found the
    hidden states."""
    if isinstance(output, torch.Tensor):
        return logits
    if hasattr(output, "logits"):
        output.logits = logits
        return output
    return type(output)([logits, *output[1:]])


def take_head(module: Any, loss_fn: Any) -> nn.Linear | None:
    """With ``loss_fn`` a :class:`VocabParallelCrossEntropy`, takes its head out of
    ``module`` (an ``nn.Identity`` in its place) before the model is cut; else None.

    Raises:
        ConveyorError: not an ``nn.Module``, no such module, not a linear layer, on the
            meta device, or tied to another weight of the model.
    """
    if not isinstance(loss_fn, VocabParallelCrossEntropy):
        return None
    name = loss_fn.head
    if not isinstance(module, nn.Module):
        raise ConveyorError("VocabParallelCrossEntropy takes the head out of an nn.Module; "
                            "build the model rather than a layer builder")
    try:
        head = module.get_submodule(name)
    except AttributeError:
        raise ConveyorError(f"VocabParallelCrossEntropy({name!r}): the model has no module "
                            f"{name!r}; name its output head") from None
    if not isinstance(head, nn.Linear):
        raise ConveyorError(f"VocabParallelCrossEntropy({name!r}): {name} is a "
                            f"{type(head).__name__}, not an nn.Linear into the vocabulary")
    if head.weight.is_meta:
        raise ConveyorError(f"VocabParallelCrossEntropy({name!r}): the head is on the meta "
                            "device; build the model with its weights first")
    for other, param in module.named_parameters(remove_duplicate=False):
        if param is head.weight and not other.startswith(f"{name}."):
            raise ConveyorError(
                f"VocabParallelCrossEntropy({name!r}): {name}.weight is tied to {other}; "
                "a tied head is not split (untie it, e.g. tie_word_embeddings=False)")
    parent, _, leaf = name.rpartition(".")
    setattr(module.get_submodule(parent) if parent else module, leaf, nn.Identity())
    return head


def split_head(pipe: nn.Module, loss_fn: VocabParallelCrossEntropy, head: nn.Linear,
               devices: Mapping[int, torch.device], ranks: int) -> VocabShards:
    """Gives ``loss_fn`` the shards of ``head`` held on ``devices`` (this process's
    ranks), for ``pipe`` to hold as ``vocab_shards``; in one process its ``state_dict``
    and ``load_state_dict`` keep the head whole under its own name (under torchrun each
    rank's holds its shard, ``vocab_shards.weights.<rank>``).

    Raises:
        ConveyorError: fewer outputs than ranks.
    """
    shards = VocabShards(head, devices, ranks)
    loss_fn.shards = shards
    if shards.whole_here:
        pipe.register_state_dict_post_hook(
            lambda _, state, prefix, __: whole_head_state(shards, loss_fn.head, state, prefix))
        pipe.register_load_state_dict_pre_hook(
            lambda _, state, prefix, *__: cut_head_state(shards, loss_fn.head, state, prefix))
    return shards


def whole_head_state(shards: VocabShards, head: str, state: dict[str, Any],
                     prefix: str) -> None:
    """A pipeline's ``state_dict``: the shards' entries as the head's whole weight."""
    for name, sharded in SHARDED.items():
        keys = [k for k in state if k.startswith(f"{prefix}vocab_shards.{sharded}.")]
        if keys:
            for key in keys:
                del state[key]
            state[f"{prefix}{head}.{name}"] = shards.whole(name)


def cut_head_state(shards: VocabShards, head: str, state: dict[str, Any],
                   prefix: str) -> None:
    """A pipeline's ``load_state_dict``: the head's whole weight as the shards' entries."""
    for name, sharded in SHARDED.items():
        whole = state.pop(f"{prefix}{head}.{name}", None)
        if whole is None:
            continue
        for r in range(len(shards.bounds) - 1):
            lo, hi = shards.rows(r)
            state[f"{prefix}vocab_shards.{sharded}.{r}"] = whole[lo:hi]
