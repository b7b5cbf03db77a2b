"""benchmarks/gpu.py's results as files: gpu.json, a Markdown table per part, a PNG.

Run on its own, it merges the results of several runs on one kind of GPU (a later
run's parts replace an earlier one's; each part keeps the commit it was measured at):

    python benchmarks/gpu_report.py results/gpu.json new/gpu.json --out results
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import _common

GIB = 2**30


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value / GIB:.2f}"


def tables(results: dict[str, Any]) -> list[str]:
    """One Markdown section per part that ran."""
    out = []
    for name, result in results.items():
        if "error" in result:
            out.append(f"### {name}\n\nfailed: `{result['error'].splitlines()[0]}`")
            continue
        section = SECTIONS.get(name)
        if section is not None:
            out.append(f"### {name}\n\n" + section(result))
    return out


def _tests(r: dict[str, Any]) -> str:
    failures = "".join(f"\n- {line}" for line in r["failures"])
    return f"`{r['command']}`: {r['summary']}{failures}"


def _equivalence(r: dict[str, Any]) -> str:
    failures = "".join(f"\n- {line}" for line in r["failures"])
    return (f"{r['cases']} generated cases ({r['seeds']} models) on the GPU, float64: "
            f"worst error {r['worst_error']:.1e} (tolerance {r['tolerance']:.0e}), "
            f"{len(r['failures'])} over it{failures}")


def _overhead(r: dict[str, Any]) -> str:
    rows = [[name, f"{ms:.1f}", f"{r['over_plain'][name]:.3f}",
             f"{r['over_accumulated'][name]:.3f}" if name in r["over_accumulated"] else ""]
            for name, ms in r["step_ms"].items()]
    return _common.markdown_table(["", "step (ms)", "x plain", "x plain, same M"], rows)


def _schedules(r: dict[str, Any]) -> str:
    rows = [[name, f"{ms:.1f}", f"{r['predicted_ms'][name]:.1f}",
             _gib(r["activation_bytes"][name]), _gib(r["predicted_activation_bytes"][name])]
            for name, ms in r["step_ms"].items()]
    return (f"{r['ranks']} stages on one GPU, M={r['chunks']}, no recomputation; "
            "predictions calibrated on 1f1b's time\n\n" + _common.markdown_table(
                ["schedule", "step (ms)", "predicted (ms)", "activations (GiB)",
                 "predicted (GiB)"], rows))


def _precision(r: dict[str, Any]) -> str:
    base = r["step_ms"]["float32"]  # the pipeline's; plain rows: accumulated over M=8
    rows = [[name, f"{ms:.1f}", f"{base / ms:.2f}", _gib(r["activation_bytes"][name])]
            for name, ms in r["step_ms"].items()]
    return (_common.markdown_table(["2 stages, M=8", "step (ms)", "speed x float32",
                                    "activations (GiB)"], rows)
            + _busy(r)
            + "".join(f"\n\n{name} failed: `{error}`"
                      for name, error in r.get("errors", {}).items()))


def _busy(r: dict[str, Any]) -> str:
    busy = ", ".join(f"{name} {share:.0%}" for name, share in r.get("gpu_busy", {}).items()
                     if share is not None)
    return f"\n\nGPU busy (share of a step running kernels): {busy}" if busy else ""


def _compiled(r: dict[str, Any]) -> str:
    rows = [[name, f"{ms:.1f}", _gib(r["activation_bytes"].get(name))]
            for name, ms in r["step_ms"].items()]
    speed = ", ".join(f"{name} {ratio:.2f}x" for name, ratio in r["compiled_speed"].items())
    return ("2 stages, M=8, precision='bf16' (plain rows: the caller's bf16 autocast, "
            "accumulated over M=8)\n\n"
            + _common.markdown_table(["", "step (ms)", "activations (GiB)"], rows)
            + f"\n\ncompiled against eager: {speed} (goal: 1.15x)" + _busy(r)
            + "".join(f"\n\n{name} failed: `{error}`"
                      for name, error in r.get("errors", {}).items()))


def _table1(r: dict[str, Any]) -> str:
    names = list(r["largest_layers"])  # naive, pipeline_1 (and offload, since it exists)
    long = r.get("long_context", {}).get("largest_layers", {})
    rows = [[name, r["largest_layers"][name], f"{r['parameters'][name] / 1e6:.0f}M",
             _gib(r["activation_bytes"][name]), long.get(name, "")] for name in names]
    ratios = ", ".join(f"{name} {r['parameters'][name] / max(r['parameters']['naive'], 1):.1f}x"
                       for name in names if name != "naive")
    c = r["config"]
    return (f"T(L, {c['hidden']}, {c['heads']}), width {c['width']}, batch {c['batch']} x "
            f"{c['length']}, M={c['chunks']}, RMSProp, GPU capped at "
            f"{r['memory_gib']:.0f} GiB; activations at L={r['activation_layers']}; the "
            "last column: 4 sequences of 32k tokens, one a micro-batch, vocabulary "
            f"{r.get('long_context', {}).get('config', {}).get('vocab', c['vocab'])}\n\n"
            + _common.markdown_table(["", "largest L", "parameters", "activations (GiB)",
                                      "largest L at 32k tokens"], rows)
            + f"\n\nthe parameters of naive's, trained: {ratios} (paper, Pipeline-1: 3.9x)")


def _speedup(r: dict[str, Any]) -> str:
    if "skipped" in r:
        return f"skipped: {r['skipped']}"
    rows = [[name, f"{ms:.1f}", f"{r['speedup'][name]:.2f}"] for name, ms in r["step_ms"].items()]
    return _common.markdown_table(["", "step (ms)", "speedup"], rows)


SECTIONS = {"tests": _tests, "compiled": _compiled, "equivalence": _equivalence, "overhead": _overhead,
            "schedules": _schedules, "precision": _precision, "table1": _table1,
            "speedup": _speedup}


def plot(results: dict[str, Any], path: Path) -> bool:
    """Step times per part that measured some, side by side; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = [(name, r) for name, r in results.items()
              if "step_ms" in r and "error" not in r]
    if not panels:
        return False
    figure, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4), squeeze=False)
    for axis, (name, r) in zip(axes[0], panels):
        labels = list(r["step_ms"])
        axis.bar(range(len(labels)), [r["step_ms"][k] for k in labels], label="measured")
        if "predicted_ms" in r:
            axis.plot(range(len(labels)), [r["predicted_ms"][k] for k in labels], "o",
                      color="black", label="predicted")
            axis.legend()
        axis.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
        axis.set_ylabel("step (ms)")
        axis.set_title(name)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def write_report(results: dict[str, Any], folder: str, *, smoke: bool,
                 machine: dict[str, Any] | None = None) -> list[Path]:
    """Writes gpu.json, gpu.md and gpu.png (gpu-smoke.* for a smoke run) into ``folder``;
    ``machine``: where the results were measured (by default, here)."""
    stem = "gpu-smoke" if smoke else "gpu"
    base = Path(folder)
    machine = machine or _common.machine()
    for result in results.values():
        result.setdefault("commit", machine.get("commit", "?"))
    json_path = _common.write(stem, {"results": results}, base / f"{stem}.json", machine)
    commits: dict[str, list[str]] = {}
    for name, result in results.items():
        commits.setdefault(result["commit"], []).append(name)
    at = (f"commit {next(iter(commits))}" if len(commits) == 1 else "commits " + ", ".join(
        f"{commit} ({', '.join(names)})" for commit, names in commits.items()))
    header = (f"## On a GPU\n\n{machine.get('gpu', 'no GPU (smoke run)')}, torch "
              f"{machine['torch']}, {at}\n\n")
    md_path = base / f"{stem}.md"
    md_path.write_text(header + "\n\n".join(tables(results)) + "\n")
    written = [json_path, md_path]
    if plot(results, base / f"{stem}.png"):
        written.append(base / f"{stem}.png")
    return written


def merge(paths: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The parts of several runs' gpu.json, later runs' replacing earlier ones', and the
    machine of the last. Raises ValueError for runs on different GPUs or torch versions."""
    results: dict[str, Any] = {}
    machine: dict[str, Any] = {}
    for path in paths:
        run = json.loads(Path(path).read_text())
        found = {key: run["machine"].get(key) for key in ("gpu", "gpus", "torch")}
        if machine and found != {key: machine.get(key) for key in found}:
            raise ValueError(f"{path} was measured on {found}, the runs before it on "
                             f"{ {key: machine.get(key) for key in found} }: not comparable")
        for result in run["results"].values():
            result.setdefault("commit", run["machine"].get("commit", "?"))
        results.update(run["results"])
        machine = run["machine"]
    return results, machine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="merges runs of benchmarks/gpu.py")
    parser.add_argument("runs", nargs="+", help="gpu.json files, earliest first")
    parser.add_argument("--out", default=str(_common.RESULTS))
    args = parser.parse_args(argv)
    try:
        results, machine = merge(args.runs)
    except ValueError as exc:
        parser.error(str(exc))
    for path in write_report(results, args.out, smoke=False, machine=machine):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
