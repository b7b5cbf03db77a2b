"""The machines a plan runs on: devices, their memory, and the links between them by level.

PipeDream plans for a hierarchy: devices within a node talk over one link (NVLink, PCIe),
nodes within a rack over another, racks over a third. A :class:`Cluster` states it as
levels, innermost first: ``levels[0].size`` devices make a node, ``levels[1].size`` nodes
the next level, and so on; two devices talk at the bandwidth and latency of the
innermost level that holds both. Devices are numbered node by node, so devices
``0 .. size-1`` share node 0.

A cluster comes from a small file (JSON or TOML), from flags, or from the machine
(:meth:`Cluster.detect`: the GPUs here and, under torchrun, the processes per node and
nodes; bandwidths it cannot measure are typical figures, listed in ``guessed``)::

    memory = "80GB"
    flops = 4e14
    [[levels]]
    name = "node"
    size = 8
    bandwidth = "300GB/s"
    latency = "5us"
    [[levels]]
    name = "network"
    size = 2
    bandwidth = "100Gbps"
    latency = "20us"
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from conveyor.errors import ConveyorError
from conveyor.observe.plan import parse_bytes

__all__ = ["Cluster", "Level", "parse_bandwidth", "parse_seconds"]

# What detect() assumes where it cannot measure: a GPU node's links (NVLink-class) and
# its network (100 Gb/s Ethernet or InfiniBand), one CPU node's shared memory.
_GUESSES = {"cuda": (200e9, 5e-6), "network": (12.5e9, 2e-5), "cpu": (10e9, 2e-6)}
#: An all-gather's (a reduce-scatter's) seconds against an all-reduce's on a ring: half.
RING_SHARE = 0.5


@dataclass(frozen=True)
class Level:
    """One level of the hierarchy.

    Attributes:
        name: what it is ("node", "rack", "network").
        size: how many of the level below it holds (devices, for the first level).
        bandwidth: bytes per second between two devices that first meet at this level,
            in each direction.
        latency: seconds added to every message at this level.
    """

    name: str
    size: int
    bandwidth: float
    latency: float = 0.0


@dataclass(frozen=True)
class Cluster:
    """Devices, their memory and speed, and the levels that link them.

    Attributes:
        levels: innermost first.
        memory: bytes per device.
        flops: floating-point operations per second one device sustains (for plans
            made from FLOP counts rather than timed runs).
        guessed: the figures :meth:`detect` assumed rather than found.
        action_s: the host's seconds per action (one micro-batch's forward or backward
            on one stage) beyond its layers' own: the runtime's dispatch and
            bookkeeping, what a host-bound step of small layers is made of (``action``
            in a file: "300us"; 0 unless measured, as ``benchmarks/mesh.py`` does).
        step_s: the host's seconds per step on each rank beyond its actions': the
            runtime's own step (splitting the batch, the step's loss, the check that the
            gradients are finite) ("step" in a file; 0 unless measured).
        all_gather_share: an all-gather's seconds (each device its shard, all of them
            the whole) as a share of an all-reduce of the whole among the same devices:
            0.5 for rings (NCCL's); gloo's take about as long as the all-reduce.
        reduce_scatter_share: a reduce-scatter's, likewise (gloo's: longer than the
            all-reduce). FSDP's collectives are weighed with these two.
        fsdp_unit_s: the host's seconds FSDP's hooks add to one unit's forward and
            backward of a micro-batch, its parameters gathered (``fsdp_unit`` in a file;
            0 unless measured, as ``benchmarks/mesh.py`` does: 0.36 ms a block on a CPU
            core, a third of that block's own compute).
    """

    levels: tuple[Level, ...]
    memory: float
    flops: float = 1e14
    guessed: tuple[str, ...] = field(default=())
    action_s: float = 0.0
    step_s: float = 0.0
    all_gather_share: float = RING_SHARE
    reduce_scatter_share: float = RING_SHARE
    fsdp_unit_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.levels:
            raise ConveyorError("a cluster needs at least one level (devices per node)")
        for level in self.levels:
            if level.size < 1 or level.bandwidth <= 0 or level.latency < 0:
                raise ConveyorError(
                    f"level {level.name!r}: size must be at least 1, bandwidth above 0 and "
                    f"latency at least 0; got size={level.size}, bandwidth="
                    f"{level.bandwidth}, latency={level.latency}")
        if self.memory <= 0 or self.flops <= 0 or self.action_s < 0 or self.step_s < 0 \
                or self.all_gather_share <= 0 or self.reduce_scatter_share <= 0 \
                or self.fsdp_unit_s < 0:
            raise ConveyorError(f"memory, flops and the collectives' shares must be above 0 "
                                f"and action, step and fsdp_unit at least 0; got memory="
                                f"{self.memory}, flops={self.flops}, action={self.action_s}, "
                                f"step={self.step_s}, all_gather_share="
                                f"{self.all_gather_share}, reduce_scatter_share="
                                f"{self.reduce_scatter_share}, fsdp_unit={self.fsdp_unit_s}")

    @property
    def devices(self) -> int:
        return math.prod(level.size for level in self.levels)

    def level_of(self, first: int, last: int) -> int:
        """The innermost level that holds devices ``first`` .. ``last`` (0 for one device)."""
        span = 1
        for index, level in enumerate(self.levels):
            span *= level.size
            if first // span == last // span:
                return index
        return len(self.levels) - 1

    def transfer(self, nbytes: float, level: int) -> float:
        """Seconds to move ``nbytes`` between two devices that meet at ``level``."""
        if nbytes <= 0:
            return 0.0
        link = self.levels[level]
        return link.latency + nbytes / link.bandwidth

    def all_reduce(self, nbytes: float, replicas: int, level: int) -> float:
        """Seconds for ``replicas`` consecutive devices meeting at ``level`` to sum
        ``nbytes``, level by level as NCCL's hierarchy does: a ring among the devices of
        a node (each sends 2(n-1)/n of the bytes over its link, in 2(n-1) messages), then
        a ring among the nodes, whose uplink carries the whole node's share, and so on."""
        if replicas <= 1 or nbytes <= 0:
            return 0.0
        seconds, below = 0.0, 1
        for link in self.levels[:level + 1]:
            ring = min(math.ceil(replicas / below), link.size)
            if ring > 1:
                seconds += 2 * (ring - 1) * (link.latency + nbytes / ring / link.bandwidth)
            below *= link.size
        return seconds

    # ------------------------------------------------------------ reading and writing

    @classmethod
    def of(cls, *, nodes: int = 1, per_node: int, memory: float | str,
           intra: float | str, inter: float | str | None = None,
           intra_latency: float | str = 0.0, inter_latency: float | str = 0.0,
           flops: float = 1e14) -> Cluster:
        """Nodes of ``per_node`` devices: the common two-level cluster, from flags."""
        levels = [Level("node", per_node, parse_bandwidth(intra), parse_seconds(intra_latency))]
        if nodes > 1:
            if inter is None:
                raise ConveyorError(f"{nodes} nodes need the bandwidth between them "
                                    "(--inter-bandwidth, e.g. 25GB/s or 200Gbps)")
            levels.append(Level("network", nodes, parse_bandwidth(inter),
                                parse_seconds(inter_latency)))
        return cls(tuple(levels), _bytes(memory), flops)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Cluster:
        """Reads :meth:`to_dict`'s form; sizes and speeds may be numbers or text
        ("80GB", "300GB/s", "100Gbps", "5us").

        Raises:
            ConveyorError: a field is missing or unreadable; the message names it.
        """
        try:
            levels = tuple(Level(str(level.get("name", f"level {i}")), int(level["size"]),
                                 parse_bandwidth(level["bandwidth"]),
                                 parse_seconds(level.get("latency", 0.0)))
                           for i, level in enumerate(data["levels"]))
            return cls(levels, _bytes(data["memory"]), float(data.get("flops", 1e14)),
                       tuple(data.get("guessed", ())), parse_seconds(data.get("action", 0.0)),
                       parse_seconds(data.get("step", 0.0)),
                       float(data.get("all_gather_share", RING_SHARE)),
                       float(data.get("reduce_scatter_share", RING_SHARE)),
                       parse_seconds(data.get("fsdp_unit", 0.0)))
        except KeyError as missing:
            raise ConveyorError(f"the cluster lacks {missing}; it needs memory and levels, "
                                "each level with size and bandwidth") from None
        except (TypeError, ValueError) as exc:
            raise ConveyorError(f"cannot read the cluster: {exc}") from None

    @classmethod
    def load(cls, path: str | Path) -> Cluster:
        """Reads a cluster from a JSON or TOML file (by its suffix; JSON otherwise)."""
        path = Path(path)
        try:
            text = path.read_text()
            data = _toml(text) if path.suffix == ".toml" else json.loads(text)
        except OSError as exc:
            raise ConveyorError(f"cannot read the cluster {path}: {exc.strerror or exc}") \
                from None
        except ValueError as exc:
            raise ConveyorError(f"cannot read the cluster {path}: {exc}") from None
        try:
            return cls.from_dict(data)
        except ConveyorError as exc:
            raise ConveyorError(f"{path}: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        return {"levels": [asdict(level) for level in self.levels], "memory": self.memory,
                "flops": self.flops, "guessed": list(self.guessed), "action": self.action_s,
                "step": self.step_s, "all_gather_share": self.all_gather_share,
                "reduce_scatter_share": self.reduce_scatter_share,
                "fsdp_unit": self.fsdp_unit_s}

    def describe(self) -> str:
        """One line: ``2 x 8 devices of 80.0 GB; node 300.0 GB/s, network 25.0 GB/s``."""
        sizes = " x ".join(str(level.size) for level in reversed(self.levels))
        links = ", ".join(f"{level.name} {level.bandwidth / 1e9:.1f} GB/s"
                          for level in self.levels)
        guessed = f" (guessed: {', '.join(self.guessed)})" if self.guessed else ""
        return f"{sizes} devices of {self.memory / 1e9:.1f} GB; {links}{guessed}"

    @classmethod
    def detect(cls) -> Cluster:
        """This machine's devices (and, under torchrun, the processes per node and the
        nodes), with typical bandwidths where none can be measured (listed in
        ``guessed``)."""
        import torch

        local = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
        world = int(os.environ.get("WORLD_SIZE", "0"))
        guessed = ["bandwidth", "latency"]
        if torch.cuda.is_available():
            per_node = local or torch.cuda.device_count()
            memory = float(torch.cuda.get_device_properties(0).total_memory)
            bandwidth, latency = _GUESSES["cuda"]
            flops, guessed = 1e14, [*guessed, "flops"]
        else:
            per_node = local or 1
            memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / per_node
            bandwidth, latency = _GUESSES["cpu"]
            flops, guessed = 1e10, [*guessed, "flops"]
        levels = [Level("node", per_node, bandwidth, latency)]
        nodes = world // per_node if world and local else 1
        if nodes > 1:
            levels.append(Level("network", nodes, *_GUESSES["network"]))
        return cls(tuple(levels), memory, flops, tuple(guessed))


def _toml(text: str) -> Any:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        raise ConveyorError("reading a TOML cluster needs Python 3.11 (tomllib); give it "
                            "as JSON, with the same keys") from None
    return tomllib.loads(text)


def _bytes(value: float | str) -> float:
    return parse_bytes(value) if isinstance(value, str) else float(value)


_RATE = re.compile(r"^([0-9.]+(?:[eE][+-]?[0-9]+)?)([kKmMgGtT]?)(i?)(B|b|bit|bits)?$")


def parse_bandwidth(value: float | str) -> float:
    """Bytes per second from a number or text: ``"25GB/s"``, ``"300 GiB/s"``,
    ``"100Gbps"`` or ``"100Gb/s"`` (a lower-case b counts bits)."""
    if not isinstance(value, str):
        return float(value)
    text = value.strip().replace(" ", "")
    for suffix in ("/s", "ps"):
        text = text.removesuffix(suffix)
    match = _RATE.match(text)
    if match is None:
        raise ValueError(f"cannot read {value!r} as a bandwidth; write e.g. 25GB/s or 100Gbps")
    number, prefix, binary, unit = match.groups()
    power = " kmgt".index(prefix.lower() or " ")
    scale = (1024 if binary else 1000) ** power
    return float(number) * scale / (8 if unit and unit != "B" else 1)


_TIMES = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def parse_seconds(value: float | str) -> float:
    """Seconds from a number or text: ``"5us"``, ``"1.5ms"``, ``"0.01s"``."""
    if not isinstance(value, str):
        return float(value)
    text = value.strip().replace(" ", "").lower()
    for unit in sorted(_TIMES, key=len, reverse=True):
        if text.endswith(unit):
            return float(text[:-len(unit)]) * _TIMES[unit]
    return float(text)
