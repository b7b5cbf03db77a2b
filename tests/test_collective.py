"""Bounded collectives of plain data: what crosses is JSON, never pickled."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

from conveyor.distributed.faults import collective


def test_exchange_carries_plain_data_and_refuses_objects(tmp_path: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        value = {"balance": [3, 4, 5], "name": "stage ü", "wait": 0.25, "none": None}
        assert collective.exchange(value, group=None, what="a test", seconds=10) == [value]
        with pytest.raises(TypeError):  # an object would need pickle: refused
            collective.exchange(object(), group=None, what="a test", seconds=10)
    finally:
        dist.destroy_process_group()
