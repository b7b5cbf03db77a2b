"""A Hugging Face model pipelined by conveyor and by torch.distributed.pipelining, and
the plain model's loss and gradients to check both against (for ``any_model.py``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["Batch", "Named", "Step", "block_count", "build", "check_gradients", "conveyor_step",
           "middle_block", "next_token_loss", "parameter_bytes", "reference", "torch_step"]

Step = Callable[[], "float | None"]
Named = Callable[[], list[tuple[str, torch.nn.Parameter]]]


def build(name: str, size: dict[str, Any], device: str = "cpu") -> tuple[torch.nn.Module, str]:
    """The model from its config, seeded, without dropout; and its blocks' name."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    with torch.device(device):
        if name == "gpt2":
            config = transformers.GPT2Config(
                vocab_size=size["vocab"], n_positions=size["length"], resid_pdrop=0.0,
                embd_pdrop=0.0, attn_pdrop=0.0, **size["gpt2"])
            return transformers.GPT2LMHeadModel(config), "transformer.h"
        llama = transformers.LlamaConfig(vocab_size=size["vocab"],
                                         max_position_embeddings=size["length"],
                                         **size["llama"])
        return transformers.LlamaForCausalLM(llama), "model.layers"


def block_count(model: torch.nn.Module, blocks: str) -> int:
    return len(list(model.get_submodule(blocks).children()))


def middle_block(model: torch.nn.Module, blocks: str) -> str:
    return f"{blocks}.{block_count(model, blocks) // 2}"


def next_token_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the logits: in a ModelOutput (conveyor, the plain model), or
    first in the flat tuple that torch's traced last stage returns."""
    logits = output.logits if hasattr(output, "logits") else output
    while isinstance(logits, (tuple, list)):
        logits = logits[0]
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def parameter_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


class Batch:
    """Token ids and targets, the same on every rank, and one micro-batch of ids."""

    def __init__(self, batch: int, length: int, chunks: int, vocab: int) -> None:
        generator = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, vocab, (batch, length), generator=generator)
        self.targets = torch.randint(0, vocab, (batch, length), generator=generator)
        self.sample = {"input_ids": self.ids[:batch // chunks], "use_cache": False}


def reference(name: str, size: dict[str, Any],
              batch: Batch) -> tuple[float, dict[str, torch.Tensor], set[str]]:
    """The plain model's loss on the whole batch, its gradient under every name of
    each parameter, and the names of its tied parameters."""
    model, _ = build(name, size)
    loss = next_token_loss(model(input_ids=batch.ids, use_cache=False), batch.targets)
    loss.backward()
    named = list(model.named_parameters(remove_duplicate=False))
    names_of: dict[int, int] = {}
    for _, p in named:
        names_of[id(p)] = names_of.get(id(p), 0) + 1
    tied = {n for n, p in named if names_of[id(p)] > 1}
    return loss.item(), {n: p.grad.clone() for n, p in named if p.grad is not None}, tied


def conveyor_step(name: str, size: dict[str, Any], batch: Batch,
                  checkpoint: str) -> tuple[Step, Named]:
    """conveyor's training step of the model cut at its middle block, and this rank's
    named parameters."""
    import conveyor

    model, blocks = build(name, size)
    pipe = conveyor.Pipeline(model, split_at=[middle_block(model, blocks)],
                             sample=batch.sample, chunks=size["chunks"], schedule="1f1b",
                             recompute=checkpoint, loss_fn=next_token_loss)
    inputs = {"input_ids": batch.ids, "use_cache": False}

    def step() -> float:
        pipe.zero_grad(set_to_none=True)
        return float(pipe.step(inputs, batch.targets))
    return step, lambda: list(pipe.named_parameters())


def torch_step(name: str, size: dict[str, Any], batch: Batch, rank: int, *,
               interpreter: bool = True) -> tuple[Step, Named]:
    """torch's training step of the model split by ``pipeline()`` at its middle block,
    with PipelineStage and Schedule1F1B; raises where torch cannot split the model.

    ``pipeline()`` unflattens each stage's graph into modules that run their nodes one by
    one through ``torch.fx.Interpreter``, its default; ``interpreter=False`` builds them
    under ``torch.export.unflatten._disable_interpreter()`` (private) to run the
    generated Python code instead, as conveyor's stages do.
    """
    from torch.distributed.pipelining import Schedule1F1B, SplitPoint, pipeline
    from torch.export.unflatten import _disable_interpreter

    model, blocks = build(name, size)
    with contextlib.nullcontext() if interpreter else _disable_interpreter():
        pipe = pipeline(model, mb_args=(), mb_kwargs=batch.sample,
                        split_spec={middle_block(model, blocks): SplitPoint.BEGINNING})
    # Every stage's forward in this process first: where one fails, it fails on every
    # rank alike, and no rank is left waiting for a peer that stopped.
    with torch.no_grad():
        pipe(**batch.sample)
    stage = pipe.build_stage(rank, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=size["chunks"], loss_fn=next_token_loss)
    module = stage.submod

    def step() -> float | None:
        module.zero_grad(set_to_none=True)
        if rank == 0:
            schedule.step(input_ids=batch.ids)
            return None
        losses: list[torch.Tensor] = []
        schedule.step(target=batch.targets, losses=losses)
        return float(torch.stack(losses).detach().mean())
    return step, lambda: list(module.named_parameters())


def check_gradients(named: list[tuple[str, torch.nn.Parameter]],
                    reference: dict[str, torch.Tensor], tied: set[str]) -> dict[str, Any]:
    """This rank's gradients against the plain model's. The plain model's tied weight
    has one gradient, the sum over its uses, which each copy should hold; the copies'
    gradients added up over the ranks tell whether they hold the parts of that sum
    instead (a collective: every rank calls it)."""
    grads = {n: g for n, p in named if (g := p.grad) is not None}
    untied = [relative_error(g, reference[n]) for n, g in grads.items() if n not in tied]
    copies = {n: g for n, g in grads.items() if n in tied}
    result: dict[str, Any] = {"untied_max_relative_error": max(untied, default=None),
                              "untied_compared": len(untied)}
    if not tied:
        return result
    result["tied_copies"] = {n: relative_error(g, reference[n]) for n, g in copies.items()}
    total = torch.zeros_like(reference[min(tied)])
    for g in {id(g): g for g in copies.values()}.values():
        total += g
    dist.all_reduce(total)
    result["copies_added_over_ranks"] = relative_error(total, reference[min(tied)])
    return result
