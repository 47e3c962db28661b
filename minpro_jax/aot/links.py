"""How long one collective takes on a slice's real links: an alpha + beta model per collective.

A TPU chip has a link to each neighbour along each physical axis of its slice (`topologies.Slice.dims`); an axis
closes into a ring only where the slice has wraparound links (`Slice.wraparound`: a v5p slice that is a multiple
of a full 4x4x4 cube, a v5e / v6e axis of 16). A collective's group occupies some of those axes; along an axis it
spans n chips, either a whole ring (every chip has two neighbours on it: 2 incoming links, floor(n / 2) hops to
the farthest) or a line (the end chip has one neighbour: 1 incoming link, n - 1 hops). So for a group (jax-ml
scaling book, sharding.md: "How is an AllGather actually performed?", "A note on ICI latency"):

  beta  = bytes one chip receives / (link bytes/s x link efficiency x sum over its axes of incoming links)
  alpha = fixed overhead + phases x hops x per-hop latency,   hops = sum over its axes of the hops above

where the bytes received are the ring algorithms' (`hlo_cost.Collective.ici_bytes`: all-gather R(n-1)/n,
all-reduce 2R(n-1)/n as a reduce-scatter then an all-gather, so 2 phases), an all-to-all moves n R / 4 across the
group's bisection (a quarter of an all-gather of the whole array, the book's "AllToAll" row), and a
collective-permute sends R over the links between its pair. A GPU node is switched (NVSwitch): one hop to any
GPU at its per-GPU NVLink rate.

The slice's chips are located by the devices' `coords` (TPU devices of `jax.experimental.topologies` have them);
without coordinates (cpu:N) a group is taken as a line of n chips.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from minpro_jax.aot.topologies import Slice


@dataclasses.dataclass(frozen=True)
class Links:
  """The links of a slice as one program sees them.

  dims: chips along each physical axis; wrap: whether each axis is a ring; link_bytes_per_s: one link, one way;
  coords: [partitions, axes] physical coordinates of each partition id of the program (None: unknown);
  switched: every chip one hop from every other (GPUs behind NVSwitch), at `link_bytes_per_s` per chip.
  """

  dims: tuple[int, ...]
  wrap: tuple[bool, ...]
  link_bytes_per_s: float
  coords: np.ndarray | None = None
  switched: bool = False

  @classmethod
  def of(cls, sl: Slice, devices: Sequence) -> "Links":
    """The links of slice `sl` for a program whose partition i runs on `devices[i]` (a mesh's `devices.flat`)."""
    coords = None
    if sl.is_tpu and devices and all(hasattr(d, "coords") for d in devices):
      coords = np.asarray([list(d.coords)[: len(sl.dims)] for d in devices], np.int64)
    return cls(sl.dims, sl.wraparound, sl.chip.ici_link_bytes_per_s, coords, switched=sl.chip.platform == "gpu")

  def group_axes(self, ids: Sequence[int]) -> list[tuple[int, bool]]:
    """(chips spanned, closes into a ring) for each physical axis the group of partitions `ids` spans."""
    ids = list(ids)
    if len(ids) <= 1:
      return []
    if self.coords is None or max(ids) >= len(self.coords):
      return [(len(ids), False)]
    at = self.coords[ids]
    out = []
    for k, (size, wrap) in enumerate(zip(self.dims, self.wrap)):
      n = len(set(at[:, k].tolist()))
      if n > 1:
        out.append((n, bool(wrap and n == size)))
    return out

  def distance(self, a: int, b: int) -> int:
    """Hops between partitions a and b (along each axis the shorter way round a ring)."""
    if self.switched or self.coords is None or max(a, b) >= len(self.coords):
      return 1
    hops = 0
    for k, (size, wrap) in enumerate(zip(self.dims, self.wrap)):
      d = abs(int(self.coords[a, k]) - int(self.coords[b, k]))
      hops += min(d, size - d) if wrap else d
    return max(hops, 1)


def collective_seconds(
    kind: str,
    result_bytes: float,
    ici_bytes: float,
    group: Sequence[int],
    links: Links,
    *,
    hop_latency: np.ndarray,
    overhead: np.ndarray,
    efficiency: np.ndarray,
    pair: tuple[int, int] | None = None,
) -> np.ndarray:
  """Seconds of one collective (module docstring), at each level of the band arrays given.

  Args:
    kind: "all-gather", "reduce-scatter", "all-reduce", "all-to-all" or "collective-permute".
    result_bytes: its result's bytes per chip (R); ici_bytes: the bytes one chip receives by the ring formulas.
    group: the partition ids of one of its groups; links: the slice's `Links`.
    hop_latency, overhead, efficiency: arrays of the forecast's levels (seconds, seconds, share of link rate).
    pair: (source, target) of a collective-permute.
  """
  bw = links.link_bytes_per_s * np.asarray(efficiency, np.float64)
  if kind == "collective-permute":
    hops = links.distance(*pair) if pair else 1
    return overhead + hops * hop_latency + result_bytes / bw
  n = len(group)
  if n <= 1:
    return np.zeros_like(bw)
  if links.switched:
    axes, ports, hops = [(n, False)], 1, 1
  else:
    axes = links.group_axes(group)
    ports = sum(2 if ring else 1 for _, ring in axes)
    hops = sum(m // 2 if ring else m - 1 for m, ring in axes)
  phases = 2 if kind == "all-reduce" else 1
  moved = n * result_bytes / 4 if kind == "all-to-all" else ici_bytes
  return overhead + phases * hops * hop_latency + moved / (bw * ports)
