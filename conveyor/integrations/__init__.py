"""Thin adapters to where users already train: the Hugging Face ``Trainer``
(``conveyor.integrations.transformers``, the ``transformers`` extra). Each imports its
framework, which ``import conveyor`` never does, and holds no logic of its own: the
pipeline, its step, clipping and saving are conveyor's."""

from __future__ import annotations

__all__: list[str] = []
