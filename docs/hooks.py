"""mkdocs hook: the figures the benchmarks write (``benchmarks/results/*.png``) are pages'
pictures too, served at ``results/<name>.png`` without a copy kept in ``docs/``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


def on_files(files: Files, config: Any) -> Files:
    for picture in sorted(RESULTS.glob("*.png")):
        files.append(File(f"results/{picture.name}", src_dir=str(RESULTS.parent),
                          dest_dir=config["site_dir"], use_directory_urls=False))
    return files
