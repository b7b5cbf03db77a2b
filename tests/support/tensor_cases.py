"""The Hugging Face models, batch, loss and plain-model references that the
tensor-parallel and FSDP scenarios share (tests/support/scenarios/tensor.py, fsdp.py):
a small Llama or Qwen3 in float64, its gradients on the whole batch, and how far a
rank's shards are from them."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import conveyor
from conveyor.graph.weights import SHARD


def _quiet() -> Any:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    return transformers


def hf_model(family: str, **sizes: int) -> nn.Module:
    """A small Llama or Qwen3 causal LM, float64, built the same on every rank."""
    t = _quiet()
    common = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=48,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                  tie_word_embeddings=False, use_cache=False)
    common.update(sizes)
    torch.manual_seed(0)
    if family == "llama":
        return t.LlamaForCausalLM(t.LlamaConfig(**common)).double()
    return t.Qwen3ForCausalLM(t.Qwen3Config(head_dim=8, **common)).double()


def batch() -> tuple[dict[str, Any], torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (8, 6), generator=generator)
    return {"input_ids": ids, "use_cache": False}, torch.randint(0, 64, (8, 6),
                                                                generator=generator)


def token_loss(result: Any, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = result.logits if hasattr(result, "logits") else result[0]
    total = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    return total, torch.tensor(targets.numel())


def plain_grads(model: nn.Module, inputs: Any, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    total, count = token_loss(model(**inputs), targets)
    (total / count).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def sharded_family(family: str, schedule: str, tensor_parallel: int = 1) -> list[Any]:
    """A Llama or Qwen3 cut with ``split_at`` into 2 stages, its replicas FSDP-sharded
    (``data_parallel=2``; world 4, or 8 with 2 tensor ranks), each on its half of the
    batch, against the plain model on the whole batch: [the worst relative gradient
    difference over this rank's parameters (a shard against the plain model's slice),
    how many, and the plain model's own floor (0 for Llama, computed in float64)]."""
    inputs, targets = batch()
    sample = {"input_ids": inputs["input_ids"][:2], "use_cache": False}
    plain = hf_model(family)
    undo = float64_norms(family) if family == "llama" else (lambda: None)
    try:
        reference = plain_grads(plain, inputs, targets)
        own = 0.0 if family == "llama" else floor(family, plain, inputs, targets, reference)
        tensor = {"tensor_parallel": tensor_parallel, "tp_plan": "auto"} \
            if tensor_parallel > 1 else {}
        pipe = conveyor.Pipeline(copy.deepcopy(plain), split_at=["model.layers.1"],
                                 sample=sample, chunks=2, schedule=schedule, loss_fn=token_loss,
                                 data_parallel=2, sharding="fsdp", timeout=300, **tensor)
        half = slice(4 * pipe.topology.data_rank, 4 * pipe.topology.data_rank + 4)
        pipe.step({"input_ids": inputs["input_ids"][half], "use_cache": False}, targets[half])
    finally:
        undo()
    worst, count = 0.0, 0
    for name, param in pipe.named_parameters():
        grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
        expected = reference[name]
        if grad.shape != expected.shape:  # this tensor rank's shard
            dim = next(i for i in range(grad.dim()) if grad.shape[i] != expected.shape[i])
            expected = expected.chunk(tensor_parallel, dim)[pipe.topology.tensor_rank]
        worst = max(worst, float((grad - expected).norm() / expected.norm()))
        count += 1
    return [worst, count, own]


def difference(pipe: nn.Module, reference: dict[str, torch.Tensor]) -> tuple[float, int]:
    """The largest relative difference of this rank's gradient shards from the plain
    model's slices, and how many parameters were compared."""
    worst, count = 0.0, 0
    for name, param in pipe.named_parameters():
        expected = reference[name]
        shard = getattr(param, SHARD, None)
        if shard is not None:
            dim, index, parts = shard
            expected = expected.chunk(parts, dim)[index]
        assert param.grad is not None, name
        worst = max(worst, float((param.grad - expected).norm() / expected.norm()))
        count += 1
    return worst, count


def float64_norms(family: str) -> Any:
    """Makes the family's RMSNorm compute in float64 (its own casts to float32 removed),
    until the returned function undoes it."""
    t = _quiet()
    norm = (t.models.llama.modeling_llama.LlamaRMSNorm if family == "llama"
            else t.models.qwen3.modeling_qwen3.Qwen3RMSNorm)
    own = norm.forward

    def forward(self: Any, hidden: torch.Tensor) -> torch.Tensor:
        variance = hidden.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon))

    norm.forward = forward
    return lambda: setattr(norm, "forward", own)


def floor(family: str, model: nn.Module, inputs: Any, targets: torch.Tensor,
          reference: dict[str, torch.Tensor]) -> float:
    """The plain model's own noise: how far its gradients with its float32 norms are
    from those it gives computing them in float64."""
    undo = float64_norms(family)
    try:
        exact = plain_grads(copy.deepcopy(model), inputs, targets)
    finally:
        undo()
    return max(float((exact[n] - r).norm() / r.norm()) for n, r in reference.items())
