"""The Hugging Face Trainer runs of tests/test_hf_trainer.py: a small GPT-2 in float64
(dropout off), a token dataset with some labels masked, and the Trainer's arguments.

Under torchrun (``python -m tests.support.hf_trainer OUT_DIR STAGES``) each rank trains
pipelined and writes its stages' weights, the logged history and its evaluation to
OUT_DIR, saves the model into the run's folder, resumes from the step-2 checkpoint and
says whether it ended bit-exact where the whole run did.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

#: Every run: batches of 4 rows, 2 batches accumulated, clipped at 0.5 (the first
#: steps' norms are 0.7 to 1.9, so clipping acts).
ARGS: dict[str, Any] = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2,
                            max_steps=4, learning_rate=1e-2, max_grad_norm=0.5,
                            logging_steps=1, report_to="none", use_cpu=True,
                            save_strategy="no", disable_tqdm=True,
                            per_device_eval_batch_size=4, seed=3)


def quiet() -> Any:
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def gpt2() -> Any:
    """A 4-block GPT-2 (tied embedding and head) in float64, the same on every call."""
    transformers = quiet()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=4, n_embd=32, n_head=4, vocab_size=100,
                                     n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config).double()


def tokens(count: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """Sequences of 12 tokens, the first ``i % 5`` labels of the i-th masked (-100),
    so micro-batches, batches and replicas count different numbers of tokens."""
    generator = torch.Generator().manual_seed(seed)
    examples = []
    for i in range(count):
        ids = torch.randint(100, (12,), generator=generator)
        labels = ids.clone()
        labels[: i % 5] = -100
        examples.append({"input_ids": ids, "labels": labels})
    return examples


def loss64(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
    """A causal LM's loss as the model's own, in the model's dtype (the model's upcasts
    the logits to float32, which would hide float64's agreement)."""
    logits = outputs["logits"]
    total = torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), reduction="sum")
    return total / num_items_in_batch


def arguments(folder: str | Path, **changes: Any) -> Any:
    return quiet().TrainingArguments(output_dir=str(folder), **{**ARGS, **changes})


def history(trainer: Any) -> list[tuple[float, float]]:
    """(loss, grad_norm) of each logged step."""
    return [(h["loss"], float(h["grad_norm"])) for h in trainer.state.log_history if "loss" in h]


def plain(folder: str | Path, *, replicas: int = 1, **changes: Any) -> Any:
    """The plain Trainer, trained: ``replicas`` data-parallel ranks' batches as one (for
    evaluation too: the Trainer counts an evaluation batch's tokens over the replicas)."""
    transformers = quiet()
    batch = ARGS["per_device_train_batch_size"] * replicas
    trainer = transformers.Trainer(
        model=gpt2(), args=arguments(folder, per_device_train_batch_size=batch,
                                     per_device_eval_batch_size=batch, **changes),
        train_dataset=tokens(48), eval_dataset=tokens(16, seed=2), compute_loss_func=loss64)
    trainer.train()
    return trainer


def pipelined(folder: str | Path, *, stages: int = 2, resume: str | None = None,
              **changes: Any) -> Any:
    """The PipelineTrainer (2 micro-batches of 2 rows per batch, 1F1B), trained."""
    from conveyor.integrations.transformers import PipelineTrainer

    quiet()
    trainer = PipelineTrainer(
        model=gpt2(), args=arguments(folder, **changes), train_dataset=tokens(48),
        eval_dataset=tokens(16, seed=2), compute_loss_func=loss64,
        pipeline={"stages": stages, "chunks": 2, "schedule": "1f1b"})
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def main() -> None:
    out, stages = Path(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(1)
    trainer = pipelined(out / "run", stages=stages, save_strategy="steps", save_steps=2)
    rank = int(os.environ["RANK"])
    evaluation = trainer.evaluate()
    trainer.save_model()  # into the folder of the checkpoints, as the Trainer does
    torch.save(trainer.pipe.state_dict(), out / f"weights{rank}.pt")
    resumed = pipelined(out / "again", stages=stages, resume=str(out / "run" / "checkpoint-2"))
    exact = all(torch.equal(resumed.pipe.state_dict()[k], v)
                for k, v in trainer.pipe.state_dict().items())
    (out / f"history{rank}.json").write_text(json.dumps(
        {"history": history(trainer), "eval_loss": evaluation["eval_loss"],
         "resumed_exactly": exact, "resumed_history": history(resumed)}))
    # As tests/support/scenarios end: every rank done before any leaves (a pipeline's
    # watcher sees a peer that left), the group destroyed, then the interpreter's own
    # finalization, as a user's training script ends.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
