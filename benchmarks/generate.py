"""conveyor.generate against model.generate: greedy decoding of transformers' GPT-2 and
Llama (small configs, float32, eval mode), the model cut into 2 stages on CPU threads.

Both decode the same prompts with a key/value cache; conveyor's runs the pipeline's
modules stage by stage (each stage's cache on its device) and must give the same tokens
(checked before timing). On one CPU both run the same arithmetic, so the ratio is the
cost of conveyor's loop and device hooks; across GPUs it would add one hidden-state
transfer per stage boundary and token, as any multi-device ``model.generate`` does.

    python benchmarks/generate.py                  # about a minute
    python benchmarks/generate.py --tokens 16 --rounds 2   # quick
"""

from __future__ import annotations

import argparse
import copy
import sys
from typing import Any

import _common

_common.prepare_process()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402

import conveyor  # noqa: E402

transformers.utils.logging.set_verbosity_error()


def models() -> dict[str, tuple[Any, str]]:
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=8, n_embd=256, n_head=8, vocab_size=2000, n_positions=512,
        eos_token_id=None))  # no end token: every call decodes --tokens tokens
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=8, hidden_size=256, intermediate_size=688, num_attention_heads=8,
        num_key_value_heads=4, vocab_size=2000, eos_token_id=None))
    return {"gpt2": (gpt2, "transformer.h.4"), "llama": (llama, "model.layers.4")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per call")
    parser.add_argument("--prompt", type=int, default=16, help="prompt length")
    parser.add_argument("--batch", type=int, default=1, help="prompts per call")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    results: dict[str, Any] = {}
    rows = []
    for name, (model, split_at) in models().items():
        model.eval()
        reference = copy.deepcopy(model)
        prompts = torch.randint(0, 2000, (args.batch, args.prompt))
        pipe = conveyor.Pipeline(model, split_at=[split_at], stages=2, chunks=2,
                                 sample={"input_ids": prompts[:1], "use_cache": False},
                                 devices=["cpu"] * 2,
                                 loss_fn=lambda out, y: F.cross_entropy(out.logits, y))
        ours = conveyor.generate(pipe, model, prompts, max_new_tokens=args.tokens)
        theirs = reference.generate(prompts, max_new_tokens=args.tokens, do_sample=False)
        same = bool(torch.equal(ours, theirs))
        print(f"{name}: tokens equal: {same}", file=sys.stderr)
        times = _common.round_robin({
            "model.generate": lambda: reference.generate(
                prompts, max_new_tokens=args.tokens, do_sample=False),
            "conveyor.generate": lambda: conveyor.generate(
                pipe, model, prompts, max_new_tokens=args.tokens),
        }, args.rounds)
        ms = _common.median_ms(times)
        ratio = ms["conveyor.generate"] / ms["model.generate"]
        results[name] = {"split_at": [split_at], "tokens_equal": same,
                         "median_ms": ms, "ratio": ratio,
                         "ms_per_token": {k: v / args.tokens for k, v in ms.items()}}
        rows.append([name, f"{ms['model.generate']:.0f}", f"{ms['conveyor.generate']:.0f}",
                     f"{ratio:.2f}", same])
    print(_common.markdown_table(
        ["model", "model.generate (ms)", "conveyor.generate (ms)", "ratio", "same tokens"],
        rows))
    path = _common.write("generate", {
        "tokens": args.tokens, "prompt": args.prompt, "batch": args.batch,
        "rounds": args.rounds, "threads": torch.get_num_threads(), "results": results})
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
