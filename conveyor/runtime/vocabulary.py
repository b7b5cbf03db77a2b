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

The pipeline registers the shards as ``pipe.vocab_shards`` (what the optimizer steps);
its ``state_dict`` holds the head's weight whole under its own name, as the plain model's
does, and ``load_state_dict`` cuts it again. Inference (``pipe(x)``, ``eval_step``)
returns the whole logits in the head's place. One process only (ranks on threads): the
shards are on the devices of its ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from conveyor.errors import ConveyorError

__all__ = ["VocabParallelCrossEntropy"]


class VocabParallelCrossEntropy:
    """``loss_fn=``: the cross-entropy of the model's head ``head`` (an ``nn.Linear``
    into the vocabulary, not tied to another weight), split over the pipeline's ranks.

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

    def __repr__(self) -> str:
        return f"VocabParallelCrossEntropy({self.head!r}, ignore_index={self.ignore_index})"

    def __call__(self, output: Any, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.shards is None:
            raise ConveyorError("VocabParallelCrossEntropy is a loss_fn of conveyor.Pipeline, "
                                "which gives it the head's shards; it was called outside one")
        hidden = hidden_of(output)
        targets = targets.reshape(-1).to(hidden.device)
        valid = targets != self.ignore_index
        loss_sum = _CrossEntropy.apply(hidden, targets, valid, self.shards)
        return loss_sum, valid.sum()


class VocabShards(nn.Module):
    """The head's weight (and bias) cut by rows, one shard on each of ``devices``."""

    def __init__(self, head: nn.Linear, devices: Sequence[torch.device]) -> None:
        super().__init__()
        vocabulary = head.out_features
        if vocabulary < len(devices):
            raise ConveyorError(f"the head has {vocabulary} outputs, fewer than the "
                                f"{len(devices)} ranks to split them over")
        self.bounds = [vocabulary * r // len(devices) for r in range(len(devices) + 1)]
        rows = list(zip(self.bounds, self.bounds[1:]))
        self.weights = nn.ParameterList(
            _shard(head.weight, lo, hi, device) for (lo, hi), device in zip(rows, devices))
        self.biases = nn.ParameterList(
            _shard(head.bias, lo, hi, device) for (lo, hi), device in zip(rows, devices)
        ) if head.bias is not None else None

    def parts(self) -> list[tuple[nn.Parameter, nn.Parameter | None, int, int]]:
        """Per shard: its weight, bias (or None) and rows ``lo .. hi - 1``."""
        biases = list(self.biases) if self.biases is not None else [None] * len(self.weights)
        return [(w, b, lo, hi) for w, b, lo, hi in
                zip(self.weights, biases, self.bounds, self.bounds[1:])]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The whole head's output on ``hidden`` (inference), on its device."""
        return torch.cat([nn.functional.linear(hidden.to(w.device), w, b).to(hidden.device)
                          for w, b, _, _ in self.parts()], dim=-1)

    def with_logits(self, output: Any) -> Any:
        """The last stage's output with the whole head's logits in the hidden states'
        place (inference)."""
        if isinstance(output, torch.Tensor):
            return self.logits(output)
        if hasattr(output, "logits"):
            output.logits = self.logits(output.logits)
            return output
        return type(output)([self.logits(output[0]), *output[1:]])

    def whole(self, name: str) -> torch.Tensor:
        """The head's ``name`` ("weight" or "bias") whole, on the CPU."""
        shards = getattr(self, SHARDED[name])
        return torch.cat([shard.detach().cpu() for shard in shards])


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
        logits = []
        with torch.autocast(here.type, enabled=False):  # the softmax wants full precision
            for w, b, _, _ in shards.parts():
                dtype = torch.promote_types(flat.dtype, w.dtype)
                logits.append(nn.functional.linear(
                    flat.to(w.device, dtype), w.to(dtype), None if b is None else b.to(dtype)))
        top = torch.stack([z.amax(dim=1).to(here) for z in logits]).amax(dim=0)
        total = sum(((z - top.to(z.device)[:, None]).exp().sum(dim=1).to(here)
                     for z in logits), torch.zeros_like(top))
        picked = torch.zeros_like(top)
        for z, (_, _, lo, hi) in zip(logits, shards.parts()):
            inside = (targets >= lo) & (targets < hi)
            index = (targets - lo).clamp(0, hi - lo - 1).to(z.device)
            value = z.gather(1, index[:, None]).squeeze(1).to(here)
            picked = picked + torch.where(inside, value, torch.zeros_like(value))
        per_token = total.log() + top - picked
        ctx.shards = shards
        ctx.dtype, ctx.shape = hidden.dtype, hidden.shape
        ctx.save_for_backward(flat, targets, valid, top, total, *logits)
        return torch.where(valid, per_token, torch.zeros_like(per_token)).sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        flat, targets, valid, top, total, *logits = ctx.saved_tensors
        shards: VocabShards = ctx.shards
        here = flat.device
        weight = valid.to(top.dtype) * grad.to(top.dtype)  # each token's share of grad
        grad_flat = torch.zeros(flat.shape, dtype=top.dtype, device=here)
        for z, (w, b, lo, hi) in zip(logits, shards.parts()):
            device = z.device
            grad_z = (z - top.to(device)[:, None]).exp() / total.to(device)[:, None]
            inside = ((targets >= lo) & (targets < hi)).to(device)
            rows = inside.nonzero().squeeze(1)
            grad_z[rows, (targets.to(device)[rows] - lo)] -= 1
            grad_z = grad_z * weight.to(device)[:, None]
            x = flat.to(device, grad_z.dtype)
            _accumulate(w, grad_z.t() @ x)
            if b is not None:
                _accumulate(b, grad_z.sum(dim=0))
            grad_flat += (grad_z @ w.to(grad_z.dtype)).to(here)
        return grad_flat.to(ctx.dtype).reshape(ctx.shape), None, None, None


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
               devices: Sequence[torch.device], *, distributed: bool) -> VocabShards:
    """Gives ``loss_fn`` the shards of ``head`` over ``devices``, for ``pipe`` to hold
    as ``vocab_shards``, its ``state_dict`` and ``load_state_dict`` keeping the head
    whole under its own name.

    Raises:
        ConveyorError: under torchrun (the shards are on this process's ranks), or
            fewer outputs than ranks.
    """
    if distributed:
        raise ConveyorError("VocabParallelCrossEntropy splits the head over the ranks of "
                            "one process (its stages on threads, one device each); across "
                            "torchrun processes it is not supported yet")
    shards = VocabShards(head, devices)
    loss_fn.shards = shards
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
        for r, (lo, hi) in enumerate(zip(shards.bounds, shards.bounds[1:])):
            state[f"{prefix}vocab_shards.{sharded}.{r}"] = whole[lo:hi]
