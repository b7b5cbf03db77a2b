"""Pipeline a Hugging Face model as constructed: GPT-2 or Llama, no glue code.

The model is built from a small configuration (nothing is downloaded) on the meta
device, so it costs no memory; each stage gives storage only to its own weights,
initialised by the model's own initialiser. It learns to predict the next byte of
Python's standard library sources. The same script runs both ways:

    python examples/huggingface.py --model llama                 # 2 stages on threads
    torchrun --standalone --nproc-per-node 2 examples/huggingface.py --model llama

Both runs print the same losses. Needs the ``transformers`` package.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import transformers
from conveyor.train.data import text_corpus

import conveyor

LENGTH = 64
BATCH = 16


def build(name: str, layers: int) -> tuple[torch.nn.Module, str]:
    """A small model on the meta device, and the name of its list of blocks."""
    if name == "gpt2":
        config = transformers.GPT2Config(n_layer=layers, n_embd=128, n_head=4, vocab_size=256,
                                         n_positions=LENGTH)
        with torch.device("meta"):
            return transformers.GPT2LMHeadModel(config), "transformer.h"
    config = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=128,
                                      intermediate_size=256, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=256)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config), "model.layers"


def next_token_loss(output: transformers.modeling_outputs.CausalLMOutput,
                   targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits.flatten(0, 1), targets.flatten())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["gpt2", "llama"], default="gpt2")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    transformers.utils.logging.set_verbosity_error()

    torch.manual_seed(0)
    model, blocks = build(args.model, args.layers)
    corpus = text_corpus(limit=1 << 20)
    inputs, _ = corpus.batch(0, BATCH // args.chunks, LENGTH)
    # Stage k begins at block k * layers / stages; the model's forward is traced on a
    # micro-batch of keyword arguments, as the model takes them.
    split_at = [f"{blocks}.{k * args.layers // args.stages}" for k in range(1, args.stages)]
    pipe = conveyor.Pipeline(model, split_at=split_at, stages=args.stages,
                             sample={"input_ids": inputs, "use_cache": False},
                             chunks=args.chunks, schedule=args.schedule,
                             loss_fn=next_token_loss)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    show = not pipe.topology.distributed or torch.distributed.get_rank() == 0
    if show:
        print(f"{args.model}: {args.stages} stages split at {split_at}, "
              f"{sum(p.numel() for p in pipe.parameters())} parameters here", flush=True)
    for step in range(1, args.steps + 1):
        inputs, targets = corpus.batch(step, BATCH, LENGTH)
        optimizer.zero_grad()
        loss = pipe.step({"input_ids": inputs, "use_cache": False}, targets)
        pipe.clip_grad_norm_(1.0)
        optimizer.step()
        if show and (step == 1 or step % 10 == 0 or step == args.steps):
            print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
