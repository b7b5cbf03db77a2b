"""``conveyor.generate``: token-by-token decoding of a causal language model that a pipeline
was cut from, each stage's layers on its device with their own key/value cache.

A pipeline's stages are traced programs of one forward on the sample: they keep nothing
between calls, so the key/value cache that makes decoding cheap cannot live in them.
Decoding runs the model's own modules instead, the very ones the pipeline holds (the
pipeline adopted them: the same parameters, on each stage's device), with the model's
own cache object::

    prefill   ids --> stage 0 (embeddings, layers 0..i) --> stage 1 (layers i+1.., head)
    step t    token --> stage 0 + its layers' cache --> stage 1 + its layers' cache

Each layer writes its keys and values on its own device, so stage k's part of the cache
stays on stage k between steps; only the hidden state (one token's, after the prefill)
crosses from one stage to the next, moved by a pre-hook on the outermost modules that sit
on one device. The logits are processed as ``model.generate`` does (float32; temperature,
then top-k, then top-p; ``torch.multinomial``), so greedy decoding gives its tokens, and
sampling its tokens for the same seed (``generator`` seeded as ``torch.manual_seed`` seeds
torch's generator before ``model.generate``).

A single sequence has nothing to overlap between stages: each token crosses them in turn,
as in ``model.generate`` over several devices. Under torchrun (one stage per process) it
refuses: the model's forward would need every stage in this process.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from conveyor.runtime.runtime import RunsRuntime
from conveyor.errors import ConveyorError
from conveyor.torchprivate import pytree

__all__ = ["generate"]


def generate(
    pipe: RunsRuntime,
    model: nn.Module,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    attention_mask: torch.Tensor | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
) -> torch.Tensor:
    """Continues ``input_ids`` by up to ``max_new_tokens`` tokens, greedily or by sampling,
    with the pipeline's stages and a key/value cache per stage.

    Example::

        pipe = conveyor.Pipeline(model, split_at=["model.layers.2"], sample=..., ...)
        ids = conveyor.generate(pipe, model, prompt, max_new_tokens=20)
        # == model.generate(prompt, max_new_tokens=20, do_sample=False) token for token

    Args:
        pipe: a ``GPipe`` or ``Pipeline`` built in this process from ``model``, cut at
            ``split_at`` (given or chosen).
        model: the causal language model the pipeline was built from (a Hugging Face
            ``...ForCausalLM``, or any module whose forward takes ``input_ids``,
            ``attention_mask``, ``use_cache`` and a cache, and returns ``logits`` and the
            cache).
        input_ids: the prompts, ``[batch, length]`` (any number of rows: one is fine).
        max_new_tokens: how many tokens to add at most.
        do_sample: sample from the processed distribution rather than take its argmax.
        temperature: how sampled logits are processed, as ``model.generate`` does (and
            only when sampling; None or 1.0: not applied); so are ``top_k`` and ``top_p``.
        top_k: keep the k likeliest tokens. Unlike ``model.generate`` there is no
            default top-k of 50: pass it to match.
        top_p: keep the likeliest tokens whose probabilities add up to p.
        generator: the random generator sampling draws from, on ``input_ids``' device
            (default: torch's).
        attention_mask: ``[batch, length]``, 0 at padding (default: all ones).
        eos_token_id: token(s) that end a sequence; later tokens of an ended sequence are
            ``pad_token_id``; generation stops when every sequence has ended. Default:
            the model's ``generation_config`` (as ``model.generate``); ``[]``: none.
        pad_token_id: default: the model's ``generation_config``, else the first end token.

    Returns:
        ``input_ids`` followed by the new tokens, ``[batch, length + new]``, on
        ``input_ids``' device.

    Raises:
        ConveyorError: under torchrun; ``model`` is not the pipeline's; the pipeline is a
            sequence of layers (no cut to decode through); bad options.
    """
    _check(pipe, model, input_ids, max_new_tokens, generator)
    ends = _end_tokens(model, eos_token_id, input_ids.device)
    pad = _pad_token(model, pad_token_id, ends)
    cache_name = _cache_argument(model)
    ids = input_ids
    mask = torch.ones_like(ids) if attention_mask is None else attention_mask.to(ids.device)
    unfinished = torch.ones(ids.shape[0], dtype=torch.long, device=ids.device)
    cache: Any = None
    first = _stage_device(pipe, 0)
    with torch.no_grad(), _aligned(model):
        for _ in range(max_new_tokens):
            fresh = ids if cache is None else ids[:, -1:]
            arguments = {"input_ids": fresh.to(first), "attention_mask": mask.to(first),
                         "use_cache": True, cache_name: cache}
            out = model(**arguments)
            cache = _cache_of(out, cache_name)
            logits = out["logits"][:, -1].to(copy=True, dtype=torch.float32, device=ids.device)
            if do_sample:
                scores = _warp(logits, temperature, top_k, top_p)
                probs = torch.softmax(scores, dim=-1)
                tokens = torch.multinomial(probs, 1, generator=generator).squeeze(1)
            else:
                tokens = torch.argmax(logits, dim=-1)
            if ends is not None:
                tokens = tokens * unfinished + pad * (1 - unfinished)
            ids = torch.cat([ids, tokens[:, None]], dim=-1)
            mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=-1)
            if ends is not None:
                unfinished = unfinished & ~torch.isin(tokens, ends)
                if not bool(unfinished.any()):
                    break
    return ids


def _check(pipe: RunsRuntime, model: nn.Module, input_ids: torch.Tensor,
           max_new_tokens: int, generator: torch.Generator | None) -> None:
    if pipe.runtime.topology.distributed:
        raise ConveyorError(
            "conveyor.generate runs the model's forward across every stage in one process, "
            "but under torchrun this process holds only its own stages; generate in one "
            "process (stages on threads or devices), or use eval_step for a pipelined "
            "forward without a cache")
    if pipe.split_at is None:
        raise ConveyorError(
            "conveyor.generate decodes a model cut at split_at (given or chosen), whose "
            "modules keep a key/value cache; this pipeline runs a sequence of layers: call "
            "eval_step on the whole sequence for each new token instead")
    held = {id(p) for p in pipe.parameters()}
    foreign = [name for name, p in model.named_parameters() if id(p) not in held]
    if foreign:
        raise ConveyorError(
            f"model is not the one the pipeline was built from ({foreign[0]!r} is not a "
            "parameter of the pipeline); pass the model object given to the pipeline")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or \
            max_new_tokens < 1:
        raise ConveyorError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ConveyorError(f"input_ids must be [batch, length] with length >= 1, got shape "
                            f"{tuple(input_ids.shape)}")
    if generator is not None and generator.device.type != input_ids.device.type:
        raise ConveyorError(f"generator is on {generator.device} but tokens are sampled on "
                            f"input_ids' device {input_ids.device}; use a generator there")


def _stage_device(pipe: RunsRuntime, stage: int) -> torch.device:
    return pipe.runtime.stage_device(stage)


def _end_tokens(model: nn.Module, given: int | Sequence[int] | None,
                device: torch.device) -> torch.Tensor | None:
    value: Any = given
    if value is None:
        value = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    tokens = [value] if isinstance(value, int) else list(value or ())
    return torch.tensor(tokens, dtype=torch.long, device=device) if tokens else None


def _pad_token(model: nn.Module, given: int | None, ends: torch.Tensor | None) -> int:
    if given is not None:
        return given
    pad = getattr(getattr(model, "generation_config", None), "pad_token_id", None)
    if pad is not None:
        return int(pad)
    return int(ends[0]) if ends is not None else 0


def _cache_argument(model: nn.Module) -> str:
    """The name the model's forward takes its cache under (Hugging Face renamed it)."""
    parameters = inspect.signature(model.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in parameters:
            return name
    raise ConveyorError(
        f"{type(model).__name__}.forward takes no key/value cache (neither 'cache' nor "
        "'past_key_values'): conveyor.generate decodes causal language models that keep one")


def _cache_of(out: Any, name: str) -> Any:
    cache = out.get(name) if hasattr(out, "get") else None
    if cache is None:
        raise ConveyorError(f"the model returned no {name!r} with use_cache=True; "
                            "conveyor.generate needs its key/value cache")
    return cache


def _warp(logits: torch.Tensor, temperature: float, top_k: int | None,
          top_p: float | None) -> torch.Tensor:
    """Sampled logits processed as ``model.generate`` does: temperature, top-k, top-p."""
    scores = logits
    if temperature is not None and temperature != 1.0:
        scores = scores / temperature
    if top_k is not None and top_k != 0:
        k = min(top_k, scores.shape[-1])
        kth = torch.topk(scores, k)[0][..., -1, None]
        scores = scores.masked_fill(scores < kth, -float("inf"))
    if top_p is not None and top_p < 1.0:
        ordered, indices = torch.sort(scores, descending=False)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - top_p)
        remove[..., -1:] = False  # keep at least one token
        scores = scores.masked_fill(remove.scatter(1, indices, remove), -float("inf"))
    return scores


class _aligned:
    """Within: every outermost module whose tensors sit on one device gets its inputs
    moved there (a stage's first block takes the hidden state from the previous stage;
    rotary tables and masks made on stage 0 reach every later block)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.handles: list[Any] = []

    def __enter__(self) -> None:
        for module, device in _single_device_roots(self.model):
            self.handles.append(module.register_forward_pre_hook(
                _mover(device), with_kwargs=True))

    def __exit__(self, *exc: Any) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def _single_device_roots(model: nn.Module) -> list[tuple[nn.Module, torch.device]]:
    """The outermost modules whose parameters and buffers all sit on one device."""
    found: list[tuple[nn.Module, torch.device]] = []

    def visit(module: nn.Module) -> None:
        devices = {t.device for t in (*module.parameters(), *module.buffers())}
        if len(devices) == 1:
            found.append((module, devices.pop()))
            return
        for child in module.children():
            visit(child)
    visit(model)
    return found


def _mover(device: torch.device) -> Any:
    def move(module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        return pytree.tree_map_only(torch.Tensor, lambda t: t.to(device), (args, kwargs))
    return move
