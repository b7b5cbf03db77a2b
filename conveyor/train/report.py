"""What a finished ``conveyor train`` run leaves in ``--out``: ``summary.json``, the
training curve, and the recorded step as a timeline, a Chrome trace and a Gantt chart."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from conveyor.schedules.timeline import Timeline, plot_timelines
from conveyor.train.options import TrainConfig

__all__: list[str] = []


def write_report(out: Path, config: TrainConfig, history: list[dict[str, Any]], unigram: float,
                 timeline: Timeline | None, sample: str, seconds: float, tokens: int, *,
                 unit: str = "byte") -> None:
    """Writes the summary and pictures; ``tokens`` were trained on in ``seconds``;
    the figures are bits per ``unit`` (byte, or token with a tokenizer)."""
    metric = f"bp{unit[0]}"
    final = next(e[f"heldout_{metric}"] for e in reversed(history)
                 if f"heldout_{metric}" in e)
    written = ["checkpoint", "summary.json"]
    if timeline is not None:  # None when the resumed run had no step left to take
        timeline.save(out / "step.timeline.json")
        timeline.save_chrome_trace(out / "step.trace.json")
        written += ["step.timeline.json", "step.trace.json"]
    try:
        _plot_curve(history, unigram, out / "curve.png", unit)
        written.append("curve.png")
        if timeline is not None:
            plot_timelines([timeline], out / "step.png",
                           titles=[f"measured {config.schedule} step"])
            written.append("step.png")
    except ImportError:
        print("matplotlib is not installed: no pictures (pip install 'conveyor[plots]')")
    skipped = sum(1 for e in history if e.get("skipped"))
    summary = {f"heldout_{metric}": final, f"unigram_{metric}": unigram, "unit": unit,
               "steps": history[-1]["step"],
               "final_loss": history[-1]["loss"], "skipped_steps": skipped, "seconds": seconds,
               "tokens_per_second": tokens / seconds if seconds else 0.0,
               "bubble": timeline.mean_bubble if timeline else None,
               "config": asdict(config), "history": history, "sample": sample}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\nheld-out {final:.3f} bits/{unit} against the unigram's {unigram:.3f}, after "
          f"{history[-1]['step']} steps in {seconds:.0f} s"
          + (f" ({skipped} skipped: loss or gradient not finite)" if skipped else ""))
    print(f"wrote {out}/: {', '.join(written)}")
    print("\nsample (pipelined inference, from a held-out prompt):\n" + sample)


def _plot_curve(history: list[dict[str, Any]], unigram: float, path: Path, unit: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6.5, 3.6))
    steps = [e["step"] for e in history]
    axis.plot(steps, [e["loss"] / math.log(2) for e in history], color="#4C72B0", alpha=0.6,
              label="training batch")
    heldout = f"heldout_bp{unit[0]}"
    evaluated = [e for e in history if heldout in e]
    axis.plot([e["step"] for e in evaluated], [e[heldout] for e in evaluated], "o-",
              color="#DD8452", label="held-out")
    axis.axhline(unigram, color="grey", linestyle="--", label="unigram baseline")
    axis.set_xlabel("step")
    axis.set_ylabel(f"bits per {unit}")
    axis.legend(fontsize=8)
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
