"""Memory: peak activation memory of one stage, naive against re-materialized.

Config P (8 blocks of Linear(512, 2048)-GELU-Linear(2048, 512), N=256) cut into K
equal stages; one stage of L/K blocks runs its GPipe column (M forwards, then M
backwards) for checkpoint modes never (naive), except_last (the paper) and always.

Exact method: a dispatch mode sees every operation, and layer hooks tell which ones run
inside a layer's forward (first pass or recomputation). Each storage such an operation
creates counts from its creation until it is freed (a finalizer on the storage object,
which lives exactly as long as the memory, also when only autograd still holds it).
The peak of that sum over the step is the stage's activation memory, plus the stage
inputs it keeps (N x 512 floats), which a K=1 run receives from the caller and so
does not create itself.

The paper's law: naive holds every activation, (L/K) * N * a; re-materialization holds
the stage's boundary tensors for all micro-batches plus one micro-batch's activations,
N * b + (L/K) * (N/M) * a. Here a (activation bytes per sample per block) is measured
on the naive M=1 run and b (boundary bytes per sample: input and output) is 2 * 512 * 4.

    python benchmarks/memory.py               # about 30 seconds
    python benchmarks/memory.py --schedules   # V-Half and V-Min against 1F1B, a minute
    python benchmarks/memory.py --vocabulary  # the head whole or split over the ranks

``--schedules``: one step of config P on K=4 CPU threads with M=16 micro-batches and no
recomputation under 1F1B, ZB-V, V-Half and V-Min (the V shapes in 2K stages of one
block), each rank's peak of the bytes its forwards save for backward (a pack hook
around each stage's forward counts each storage from when it is saved until it is
freed), as a share of 1F1B's; then each with ``offload="activations"``, whose own pack
hook counts what stays on the device or comes back for a backward (checked against
ours on a run that offloads nothing).

``--vocabulary``: one 1F1B step of a Transformer LM (8 blocks of width 256, a 32k
vocabulary, untied head) on K=4 CPU threads, M=8, with its head and cross-entropy whole
on the last stage or split over the ranks (``VocabParallelCrossEntropy``): per rank, the
parameter bytes and the peak bytes saved for backward, the loss's included.
"""

from __future__ import annotations

import argparse
import sys
import threading
import weakref
from typing import Any

import _common

_common.prepare_process()
sys.path.insert(0, str(_common.ROOT))  # tests.support.saved_bytes, the meter

import torch  # noqa: E402
import torch.utils._pytree as pytree  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import conveyor  # noqa: E402
from conveyor import GPipe  # noqa: E402
from conveyor.engine import offload as offloading  # noqa: E402
from conveyor.schedules import V_SHAPES, build  # noqa: E402
from conveyor.schedules.simulate import CostModel, simulate  # noqa: E402
from conveyor.train.models import feed_forward_stack, transformer_lm  # noqa: E402
from tests.support.saved_bytes import RankBytes  # noqa: E402

BLOCKS, WIDTH, BATCH = 8, 512, 256
SCHEDULES_COMPARED = ("1f1b", "zb-v", "v-half", "v-min")


class ActivationMemory(TorchDispatchMode):
    """Live and peak bytes of storages created inside the forward of ``layers``."""

    def __init__(self, layers: nn.Module) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = self.peak = 0
        self._depth = threading.local()
        self._hooks = []
        for layer in layers:
            self._hooks.append(layer.register_forward_pre_hook(self._enter))
            # always_call: recomputation may stop early by raising inside a layer.
            self._hooks.append(layer.register_forward_hook(self._leave, always_call=True))

    def _enter(self, *_: Any) -> None:
        self._depth.value = getattr(self._depth, "value", 0) + 1

    def _leave(self, *_: Any) -> None:
        self._depth.value -= 1

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if getattr(self._depth, "value", 0) > 0:
            # Views and in-place results share an input's storage: not new memory.
            existing = {t.untyped_storage().data_ptr()
                        for t in pytree.tree_leaves((args, kwargs))
                        if isinstance(t, torch.Tensor)}
            for t in pytree.tree_leaves(out):
                if not isinstance(t, torch.Tensor):
                    continue
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key in existing or key in self.live or storage.nbytes() == 0:
                    continue
                self.live[key] = storage.nbytes()
                self.current += storage.nbytes()
                self.peak = max(self.peak, self.current)
                weakref.finalize(storage, self._free, key)
        return out

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()


def stage_peak(blocks: int, chunks: int, mode: str) -> int:
    torch.manual_seed(0)
    layers = feed_forward_stack(blocks, WIDTH, 4 * WIDTH)
    pipe = GPipe(layers, [blocks], devices=["cpu"], chunks=chunks, recompute=mode)
    x = torch.randn(BATCH, WIDTH, requires_grad=True)  # a middle stage: input gradients too
    grad = torch.randn(BATCH, WIDTH)
    tracker = ActivationMemory(layers)
    with tracker:
        pipe(x).backward(grad)
    tracker.remove_hooks()
    return tracker.peak + x.numel() * x.element_size()


class SavedBytes(RankBytes):
    """Per pipeline rank, the live and peak bytes of the tensors its stages' forwards
    save for backward: a pack hook, entered around each stage's forward in the thread
    that runs it, counts each storage once, from when it is saved until it is freed
    (with zero-bubble's split backward, at the W). Storages that exist before the step
    (the parameters, which a split backward may save as plain tensors, and the batch
    whose views are the micro-batches) are not counted."""

    def watch(self, rank: int, inputs: Any) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(
            lambda t: self._pack(t, rank), lambda t: t)

    def _pack(self, t: torch.Tensor, rank: int) -> torch.Tensor:
        if not (isinstance(t, nn.Parameter) or (t.is_leaf and t.requires_grad)):
            self.note(rank, t.untyped_storage())
        return t


class LossSavedBytes(SavedBytes):
    """:class:`SavedBytes`, and also what the loss at the last stage saves: to the last
    rank, but for a vocabulary-parallel head's logits, each shard's to the rank whose
    device holds it (the loss saves them last, in shard order)."""

    def __init__(self, pipe: conveyor.Pipeline, batch: torch.Tensor) -> None:
        super().__init__(pipe, batch)
        last = pipe.schedule.stage_ranks[-1]
        loss_fn, shards = pipe.loss_fn, pipe.vocab_shards
        ranks = pipe.schedule.num_ranks

        def measured(output: Any, targets: Any) -> Any:
            saved: list[torch.Tensor] = []
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t,
                                                          lambda t: t):
                result = loss_fn(output, targets)
            owners = [last] * len(saved)
            if shards is not None:  # the last K are the shards' logits
                owners[-ranks:] = range(ranks)
            for tensor, rank in zip(saved, owners):
                self._pack(tensor, rank)
            return result

        pipe.loss_fn = measured


def schedule_peaks(schedule: str, ranks: int, chunks: int, *,
                   offload: bool = False) -> list[int]:
    """Each rank's peak bytes saved for backward in one step of config P on ``ranks``
    CPU threads (no recomputation): L/K blocks a rank, in one stage or two (a V). With
    ``offload``, the bytes that stay on the device or come back for a backward, as the
    offload's own meter counts them (its pack hook takes the place of ours)."""
    torch.manual_seed(0)
    layers = feed_forward_stack(BLOCKS, WIDTH, 4 * WIDTH)
    stages = 2 * ranks if schedule in V_SHAPES else ranks
    pipe = conveyor.Pipeline(layers, balance=[BLOCKS // stages] * stages, chunks=chunks,
                             schedule=schedule, devices=["cpu"] * ranks, recompute="never",
                             loss_fn=nn.functional.mse_loss,
                             offload="activations" if offload else None)
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    if offload:
        pipe.step(x, y)
        return [pipe.runtime.offload_meters[r].device_peak for r in range(ranks)]
    tracker = SavedBytes(pipe, x)
    pipe.step(x, y)
    tracker.remove_hooks()
    return tracker.peak


def meters_agree(ranks: int, chunks: int) -> float:
    """The offload meter's peak over SavedBytes's, 1F1B, with every micro-batch kept on
    the device (the offload's rule made never to offload): both count the same bytes."""
    kept_within = offloading.KEPT_WITHIN
    offloading.KEPT_WITHIN = 1 << 30
    try:
        metered = schedule_peaks("1f1b", ranks, chunks, offload=True)
    finally:
        offloading.KEPT_WITHIN = kept_within
    return max(metered) / max(schedule_peaks("1f1b", ranks, chunks))


def schedules_part(ranks: int, chunks: int) -> None:
    """Peak activation memory per rank of 1F1B, ZB-V, V-Half and V-Min, without and
    with offload, measured and as a share of 1F1B's (its first rank's), beside the
    simulator's share (without offload)."""
    agreement = meters_agree(ranks, chunks)
    measured = {(name, offload): schedule_peaks(name, ranks, chunks, offload=offload)
                for offload in (False, True) for name in SCHEDULES_COMPARED}
    base = max(measured[("1f1b", False)])
    one_f_one_b = simulate(build("1f1b", ranks, chunks), CostModel.uniform(ranks)).peak_bytes[0]
    rows, results = [], []
    for (name, offload), peaks in measured.items():
        table = build(name, ranks, chunks)
        simulated = max(simulate(table, CostModel.per_rank(table)).peak_bytes) / one_f_one_b
        results.append({"schedule": name, "offload": offload, "peak_bytes_per_rank": peaks,
                         "share_of_1f1b": max(peaks) / base,
                         "simulated_share": None if offload else simulated})
        mib = 1 << 20
        rows.append([name, "activations" if offload else "-",
                     " ".join(f"{p / mib:.2f}" for p in peaks), f"{max(peaks) / base:.2f}",
                     "" if offload else f"{simulated:.2f}"])
        print(f"  {name}{' offload' if offload else ''} done", file=sys.stderr, flush=True)
    table = _common.markdown_table(
        ["schedule", "offload", "peak per rank (MiB)", "share of 1F1B's", "simulated share"],
        rows)
    print(f"\nconfig P on K={ranks} CPU threads, M={chunks}, no recomputation: bytes "
          "saved for backward (with offload: those on the device)\n")
    print(table)
    print(f"\nthe offload meter against the pack hook's count, nothing offloaded: "
          f"{agreement:.3f}")
    path = _common.write("memory-schedules", {
        "config": {"blocks": BLOCKS, "width": WIDTH, "batch": BATCH, "ranks": ranks,
                   "chunks": chunks}, "results": results, "table": table,
        "meters_agree": agreement})
    print(f"\nwrote {path}")


VOCABULARY, LM_WIDTH, LM_BLOCKS, TOKENS = 32768, 256, 8, 128


def vocabulary_peaks(ranks: int, chunks: int, *, split: bool) -> dict[str, list[int]]:
    """Per rank, the parameter bytes and the peak bytes saved for backward (the loss's
    included) of one 1F1B step of a Transformer LM with a 32k vocabulary, its head
    whole on the last stage (a stage of its own, with the final norm) or split over the
    ranks."""
    torch.manual_seed(0)
    model = transformer_lm(LM_BLOCKS, LM_WIDTH, 4 * LM_WIDTH, 4, vocab=VOCABULARY,
                           max_length=TOKENS)
    head = str(len(model) - 1)

    def whole_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    # One cut for both: the embedding and 2 blocks, 3, 3, then the final norm and the
    # head (an Identity once the head is split).
    balance = [3, 3, 3, 2] if ranks == 4 else None
    pipe = conveyor.Pipeline(
        model, balance=balance, devices=["cpu"] * ranks, chunks=chunks, schedule="1f1b",
        recompute="never",
        loss_fn=conveyor.VocabParallelCrossEntropy(head) if split else whole_loss)
    x = torch.randint(0, VOCABULARY, (2 * chunks, TOKENS))
    y = torch.randint(0, VOCABULARY, (2 * chunks, TOKENS))
    tracker = LossSavedBytes(pipe, x)
    pipe.step(x, y)
    tracker.remove_hooks()
    parameters = [0] * ranks
    for number, stage in pipe.runtime.stages.items():
        parameters[pipe.schedule.stage_ranks[number]] += sum(
            p.numel() * p.element_size() for p in stage.layers.parameters())
    for rank, shard in enumerate(pipe.vocab_shards.weights.values() if split else ()):
        parameters[rank] += shard.numel() * shard.element_size()
    return {"parameter_bytes": parameters, "saved_bytes": tracker.peak}


def vocabulary_part(ranks: int, chunks: int) -> None:
    """Per rank, parameters and peak saved activations with the head whole on the last
    stage and split over the ranks (VocabParallelCrossEntropy)."""
    rows, results = [], []
    mib = 1 << 20
    for split in (False, True):
        peaks = vocabulary_peaks(ranks, chunks, split=split)
        results.append({"vocabulary_parallel": split, **peaks})
        for what, values in peaks.items():
            rows.append(["split over the ranks" if split else "whole on the last stage",
                         what.replace("_", " "), " ".join(f"{v / mib:.1f}" for v in values),
                         f"{max(values) / (sum(values) / len(values)):.2f}"])
        print(f"  vocabulary_parallel={split} done", file=sys.stderr, flush=True)
    table = _common.markdown_table(["head", "per rank", "MiB per rank", "max / mean"], rows)
    print(f"\nTransformer LM L={LM_BLOCKS} H={LM_WIDTH} V={VOCABULARY}, {TOKENS} tokens a "
          f"sequence, 1F1B on K={ranks} CPU threads, M={chunks}, no recomputation\n")
    print(table)
    path = _common.write("memory-vocabulary", {
        "config": {"vocabulary": VOCABULARY, "width": LM_WIDTH, "blocks": LM_BLOCKS,
                   "tokens": TOKENS, "ranks": ranks, "chunks": chunks},
        "results": results, "table": table})
    print(f"\nwrote {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--schedules", action="store_true",
                        help="peak activations per rank of 1F1B, ZB-V, V-Half and V-Min "
                             "(K=4, M=16) instead")
    parser.add_argument("--vocabulary", action="store_true",
                        help="per rank, parameters and saved activations of a 32k-vocabulary "
                             "LM with its head whole or split over the ranks, instead")
    args = parser.parse_args()
    if args.schedules:
        schedules_part(4, 16)
        return 0
    if args.vocabulary:
        vocabulary_part(4, 8)
        return 0

    boundary = 2 * WIDTH * 4  # bytes per sample: a stage's input and its output
    naive_one = stage_peak(1, 1, "never")
    per_block = (naive_one - BATCH * boundary / 2) / BATCH  # a, bytes per sample per block
    rows, results = [], []
    for stages in args.stages:
        blocks = BLOCKS // stages
        for chunks in args.chunks:
            measured = {mode: stage_peak(blocks, chunks, mode)
                        for mode in ("never", "except_last", "always")}
            law_naive = blocks * BATCH * per_block + BATCH * boundary / 2
            law_remat = BATCH * boundary + blocks * (BATCH / chunks) * per_block
            results.append({"stages": stages, "blocks_per_stage": blocks, "chunks": chunks,
                            "peak_bytes": measured, "law_naive_bytes": law_naive,
                            "law_rematerialized_bytes": law_remat})
            mib = 1 << 20
            rows.append([stages, blocks, chunks, f"{measured['never'] / mib:.1f}",
                         f"{law_naive / mib:.1f}", f"{measured['except_last'] / mib:.1f}",
                         f"{measured['always'] / mib:.1f}", f"{law_remat / mib:.1f}",
                         f"{measured['never'] / measured['except_last']:.2f}x"])
            print(f"  K={stages} M={chunks} done", file=sys.stderr, flush=True)
    table = _common.markdown_table(
        ["K", "L/K", "M", "naive (MiB)", "law L/K*N*a (MiB)", "except_last (MiB)",
         "always (MiB)", "law N*b + L/K*N/M*a (MiB)", "naive / except_last"], rows)
    print(f"\nconfig P, N={BATCH}: a = {per_block / 1024:.1f} KiB of activations per sample "
          f"per block, b = {boundary / 1024:.1f} KiB per sample at stage boundaries\n")
    print(table)
    path = _common.write("memory", {
        "config": {"blocks": BLOCKS, "width": WIDTH, "hidden": 4 * WIDTH, "batch": BATCH},
        "activation_bytes_per_sample_per_block": per_block,
        "boundary_bytes_per_sample": boundary, "results": results, "table": table,
    })
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
