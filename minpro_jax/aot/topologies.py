"""Named accelerator slices for compile-only runs: devices to build a mesh over, and each chip's HBM and peaks.

A slice name is the accelerator type Google Cloud uses (`v5p-64`, `v6e-16`, `v4-8`, `v5e-4`) or `cpu:N` (N virtual
CPU devices, for tests and machines without libtpu). TPU devices come from `jax.experimental.topologies`, which
describes every host of a slice, so a 64-chip, 16-host v5p compiles here like a 4-chip one; it needs libtpu
(`pip install "jax[tpu]"`, or `make setup`, which unpacks it to `.venv/libtpu`).

Chip figures (peak dense bf16 FLOP/s, HBM capacity and bandwidth, ICI bandwidth per chip) are Google Cloud's published ones:
https://cloud.google.com/tpu/docs/v4, .../v5e, .../v5p, .../v6e (read 2026-12-01). The HBM capacity is the
documented one; the runtime keeps a little of it for itself, so a program within a few hundred MiB of it may
still not load.
"""

from __future__ import annotations

import dataclasses
import math
import re

from minpro_jax.errors import ConfigError

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
  """One accelerator generation: name, per-chip peaks, and how names count (cores per chip)."""

  generation: str
  hbm_bytes: int
  peak_bf16_flops: float  # FLOP/s, dense
  hbm_bytes_per_s: float
  cores_per_chip: int  # the slice name counts TensorCores (v4, v5p) or chips (v5e, v6e)
  chips_per_host: tuple[int, int, int]  # of a full host
  dims: int  # 3 (3D torus) or 2
  source: str
  # bytes/s one chip receives over ICI with every link busy: half the documented bidirectional per-chip figure
  ici_bytes_per_s: float = 0.0


# ICI: the documented per-chip interconnect figures (v4 2,400 Gbps, v5e 1,600 Gbps, v5p 4,800 Gbps = 1,200 GB/s
# bidirectional, v6e 800 GB/s bidirectional), as bytes/s received by one chip.
CHIPS = {
    "v4": Chip("v4", 32 * GIB, 275e12, 1228e9, 2, (2, 2, 1), 3, "https://cloud.google.com/tpu/docs/v4", 300e9),
    "v5e": Chip("v5e", 16 * GIB, 197e12, 819e9, 1, (2, 4, 1), 2, "https://cloud.google.com/tpu/docs/v5e", 200e9),
    "v5p": Chip("v5p", 95 * GIB, 459e12, 2765e9, 2, (2, 2, 1), 3, "https://cloud.google.com/tpu/docs/v5p", 600e9),
    "v6e": Chip("v6e", 32 * GIB, 918e12, 1640e9, 1, (2, 4, 1), 2, "https://cloud.google.com/tpu/docs/v6e", 400e9),
}
# The standard slice shapes by chip count (Google Cloud's tables); 2D for v5e / v6e, 3D for v4 / v5p.
SHAPES_2D = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16), 256: (16, 16)}
SHAPES_3D = {
    4: (2, 2, 1),
    8: (2, 2, 2),
    16: (2, 2, 4),
    32: (2, 4, 4),
    64: (4, 4, 4),
    128: (4, 4, 8),
    256: (4, 8, 8),
    512: (8, 8, 8),
    1024: (8, 8, 16),
    2048: (8, 16, 16),
    4096: (16, 16, 16),
}
_CPU = Chip("cpu", 0, 0.0, 0.0, 1, (1, 1, 1), 1, "virtual CPU devices (no memory limit, no peaks)")


@dataclasses.dataclass(frozen=True)
class Slice:
  """A named slice: `topology` is libtpu's name (e.g. "v5p:2x2x4"), `chips_per_host` its host bounds."""

  name: str
  chip: Chip
  num_chips: int
  topology: str
  chips_per_host: tuple[int, int, int]

  @property
  def num_hosts(self) -> int:
    return max(1, self.num_chips // math.prod(self.chips_per_host))

  @property
  def is_tpu(self) -> bool:
    return self.chip.generation != "cpu"

  def devices(self) -> list:
    """The slice's devices (TPU: abstract, compile-only; cpu:N: this process's first N CPU devices).

    Raises:
      ConfigError: `cpu:N` with fewer than N CPU devices in this process (set
        `XLA_FLAGS=--xla_force_host_platform_device_count=N` before JAX starts), or libtpu not importable.
    """
    import jax

    if not self.is_tpu:
      cpus = jax.devices("cpu")
      if len(cpus) < self.num_chips:
        raise ConfigError(
            f"--topology={self.name}: this process has {len(cpus)} CPU devices; start it with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={self.num_chips} (python -m minpro_jax.aot does)"
        )
      return cpus[: self.num_chips]
    from minpro_jax.aot.abstract import tpu_topology_devices

    try:
      return tpu_topology_devices(self.topology, self.chips_per_host)
    except Exception as e:  # noqa: BLE001 - libtpu missing or refusing the shape: say which
      raise ConfigError(
          f"--topology={self.name}: cannot describe TPU topology {self.topology} ({type(e).__name__}: "
          f"{str(e).splitlines()[0] if str(e) else ''}); TPU compiles need libtpu: `make setup` unpacks it to "
          ".venv/libtpu, or pip install 'jax[tpu]'"
      ) from e


def parse_slice(name: str) -> Slice:
  """`v5p-64` -> the 32-chip v5p slice (topology v5p:2x4x4, 8 hosts); `cpu:8` -> 8 virtual CPU devices.

  Raises:
    ConfigError: an unknown generation or a size without a standard shape, naming `--topology` and the choices.
  """
  m = re.fullmatch(r"cpu:(\d+)", name)
  if m and int(m.group(1)) > 0:
    n = int(m.group(1))
    return Slice(name, _CPU, n, f"cpu:{n}", (n, 1, 1))
  m = re.fullmatch(r"(v4|v5e|v5p|v6e|v5litepod)-(\d+)", name)
  if not m:
    raise ConfigError(
        f"--topology={name!r}: not a slice name; use <generation>-<size> with generation in {sorted(CHIPS)} "
        "(e.g. v5p-64, v6e-16, v5e-4) or cpu:N"
    )
  gen = "v5e" if m.group(1) == "v5litepod" else m.group(1)
  chip, size = CHIPS[gen], int(m.group(2))
  shapes = SHAPES_3D if chip.dims == 3 else SHAPES_2D
  chips = size // chip.cores_per_chip if size % chip.cores_per_chip == 0 else -1
  if chips not in shapes:
    sizes = ", ".join(f"{gen}-{n * chip.cores_per_chip}" for n in shapes)
    raise ConfigError(f"--topology={name}: no standard {gen} slice of that size; choose one of {sizes}")
  dims = shapes[chips]
  per_host = tuple(min(d, h) for d, h in zip(dims + (1,) * (3 - len(dims)), chip.chips_per_host))
  return Slice(name, chip, chips, f"{gen}:{'x'.join(map(str, dims))}", per_host)
