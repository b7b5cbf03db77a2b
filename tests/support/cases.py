"""The models of the multi-process tests (a deep MLP and a Transformer LM whose head is
its embedding, or its own under a vocabulary-parallel loss), their batches and losses: the scenarios run them in each process, and
the parent test (or a test in one process) builds exactly the same plain model and batch
to compare with."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import conveyor

from tests.support.models import VOCAB, WIDTH, Block


def deep_mlp(depth: int = 12) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Linear(6, 12)]
    for i in range(depth - 2):
        layers.append(nn.Tanh() if i % 2 else nn.Linear(12, 12))
    layers.append(nn.Linear(12, 3))
    return nn.Sequential(*layers).double()


def tied_lm(blocks: int = 3) -> nn.Sequential:
    """A Transformer LM whose output head is its input embedding (one Parameter)."""
    embedding = nn.Embedding(VOCAB, WIDTH)
    head = nn.Linear(WIDTH, VOCAB, bias=False)
    head.weight = embedding.weight
    return nn.Sequential(embedding, *[Block(WIDTH) for _ in range(blocks)],
                         nn.LayerNorm(WIDTH), head).double()


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


class KeptApart:
    """``loss_fn`` as a loss that a recomputed last stage does not run again in its
    backward (``recomputed_with_stage = False``, as conveyor.VocabParallelCrossEntropy):
    the loss keeps its own graph, and a split backward starts from its gradients of the
    stage's outputs."""

    recomputed_with_stage = False

    def __init__(self, loss_fn: Any) -> None:
        self.loss_fn = loss_fn

    def __call__(self, outputs: Any, targets: Any) -> Any:
        return self.loss_fn(outputs, targets)


def case_model(name: str) -> tuple[nn.Sequential, Any]:
    """The case's model and loss: "mlp", "lm" (tied), or "vlm": the LM with a head of
    its own (the same values) under a vocabulary-parallel loss."""
    torch.manual_seed(0)
    if name == "mlp":
        return deep_mlp(), nn.functional.mse_loss
    model = tied_lm()
    if name == "vlm":
        head = model[-1]
        head.weight = nn.Parameter(head.weight.detach().clone())
        return model, conveyor.VocabParallelCrossEntropy(str(len(model) - 1))
    return model, lm_loss


def case_batch(name: str, batch: int = 10, length: int = 7, seed: int = 1) -> tuple[Any, Any]:
    generator = torch.Generator().manual_seed(seed)
    if name == "mlp":
        return (torch.randn(batch, 6, dtype=torch.float64, generator=generator),
                torch.randn(batch, 3, dtype=torch.float64, generator=generator))
    return (torch.randint(0, VOCAB, (batch, length), generator=generator),
            torch.randint(0, VOCAB, (batch, length), generator=generator))


PAD = -100  # the target of a padded position

#: (schedule, stages per rank, ranks): every kind of table, V shapes included
SCHEDULES = [("gpipe", 1, 3), ("1f1b", 1, 3), ("zero-bubble", 1, 3),
             ("interleaved-1f1b", 2, 2), ("zb-v", 1, 2), ("dualpipe-v", 1, 2),
             ("v-half", 1, 2), ("v-min", 1, 3)]


def padded_batch(seed: int = 1, batch: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and targets whose rows end in padding of very different lengths: the
    last micro-batches are mostly padding."""
    x, y = case_batch("lm", batch=batch, seed=seed)
    y = y.clone()
    for row in range(batch):
        y[row, max(1, 7 - row):] = PAD
    return x, y


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    total = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=PAD,
                            reduction="sum")
    return total, (targets != PAD).sum()


def plain_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=PAD)


# A 2-rank table mixing full and split backwards: micro-batch 0 backs up fully (B) on
# stage 1 and split (I, W) on stage 0; micro-batch 1 the other way round; micro-batch 2
# like 0; micro-batch 3 split on both stages.
MIXED = """
0F0 0F1 0I0 0F2 0B1 0F3 0W0 0I2 0I3 0W3 0W2
1F0 1B0 1F1 1I1 1F2 1B2 1W1 1F3 1I3 1W3
"""


def cases(world: int) -> list[tuple[str, str, int]]:
    """(model, schedule, virtual stages) run by the equivalence scenario; "mixed" is
    the table MIXED."""
    found = [(model, schedule, 1) for model in ("mlp", "lm")
             for schedule in ("gpipe", "1f1b", "zero-bubble")]
    found.append(("mlp", "interleaved-1f1b", 2))
    if world == 2:
        found.append(("lm", "interleaved-1f1b", 2))
        found.append(("lm", "mixed", 1))
        # V shapes (4 micro-batches: 2K for dualpipe-v); the LM's tied embedding and
        # head on stages 0 and 3, both on rank 0, which also holds the loss.
        found += [("mlp", "zb-v", 1), ("lm", "zb-v", 1), ("lm", "dualpipe-v", 1)]
        # a vocabulary-parallel head: its exchanges joined from each rank's column
        found += [("vlm", "1f1b", 1), ("vlm", "zb-v", 1)]
    else:
        found += [("vlm", "zero-bubble", 1)]
    return found


def nan_on_marker(loss_fn: Any) -> Any:
    """``loss_fn``, but NaN for a micro-batch whose targets hold -1 (the marker)."""
    def loss(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if bool((targets == -1).any()):
            return torch.tensor(float("nan"), dtype=out.dtype)
        return loss_fn(out, targets)
    return loss


def lengths_batch(seed: int = 3, pad: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Four micro-batches of 3, 1, 2 and 2 sequences of lengths 5, 11, 7 and 3 (with
    ``pad``: the ends of some rows are padding, ignored by the token loss)."""
    generator = torch.Generator().manual_seed(seed)
    pairs = []
    for rows, length in ((3, 5), (1, 11), (2, 7), (2, 3)):
        x = torch.randint(0, VOCAB, (rows, length), generator=generator)
        y = torch.randint(0, VOCAB, (rows, length), generator=generator)
        if pad:
            y[0, length // 2:] = PAD
        pairs.append((x, y))
    return pairs


def packed(docs_per_row: tuple[tuple[int, ...], ...], seed: int
           ) -> list[tuple[dict[str, Any], torch.Tensor]]:
    """Micro-batches of packed documents: each row of a micro-batch holds its documents
    one after the other, ``position_ids`` restarting at each; one micro-batch per entry
    of ``docs_per_row`` (2 rows each), so each has its own length."""
    generator = torch.Generator().manual_seed(seed)
    pairs = []
    for docs in docs_per_row:
        length = sum(docs)
        ids = torch.randint(0, 100, (2, length), generator=generator)
        positions = torch.cat([torch.arange(d) for d in docs]).expand(2, length).contiguous()
        pairs.append(({"input_ids": ids, "position_ids": positions, "use_cache": False},
                      torch.randint(0, 100, (2, length), generator=generator)))
    return pairs


def plain_gradients(model_name: str, **batch: int) -> tuple[float, dict[str, torch.Tensor]]:
    """The plain model's loss on the case's batch, and its gradients by name."""
    model, loss_fn = case_model(model_name)
    x, y = case_batch(model_name, **batch)
    loss = (lm_loss if model_name == "vlm" else loss_fn)(model(x), y)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}
