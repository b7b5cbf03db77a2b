"""A 7B-parameter Llama (Llama-2-7B's shape) built on the meta device: no weights, no memory.

    conveyor plan --model examples.llama7b:model --length 4096 --batch 64 \\
        --topology examples/two_nodes.toml --save plan.json

``model()`` builds it from a ``transformers.LlamaConfig`` (nothing is downloaded);
``conveyor plan`` cuts it before each decoder layer and before the head, so the
embedding and the head are weighed like any other layer.
"""

from __future__ import annotations

import torch
from torch import nn


def model() -> nn.Module:
    import transformers

    config = transformers.LlamaConfig(hidden_size=4096, intermediate_size=11008,
                                      num_hidden_layers=32, num_attention_heads=32,
                                      num_key_value_heads=32, vocab_size=32000,
                                      max_position_embeddings=4096)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)
