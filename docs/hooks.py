"""mkdocs hooks: the home page is the README, and the figures the benchmarks write
(``benchmarks/results/*.png``) are pages' pictures too, served at ``results/<name>.png``
without a copy kept in ``docs/``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def on_files(files: Files, config: Any) -> Files:
    for picture in sorted(RESULTS.glob("*.png")):
        files.append(File(f"results/{picture.name}", src_dir=str(RESULTS.parent),
                          dest_dir=config["site_dir"], use_directory_urls=False))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    """index.md: the README, its links into ``docs/`` made relative to the site."""
    if page.file.src_uri != "index.md":
        return markdown
    readme = (ROOT / "README.md").read_text()
    return readme.replace("](docs/", "](")
