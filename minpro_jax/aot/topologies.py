"""Named accelerator slices for compile-only runs: devices to build a mesh over, and each chip's HBM and peaks.

A slice name is the accelerator type Google Cloud uses (`v5p-64`, `v6e-16`, `v4-8`, `v5e-4`) or `cpu:N` (N virtual
CPU devices, for tests and machines without libtpu). TPU devices come from `jax.experimental.topologies`, which
describes every host of a slice, so a 64-chip, 16-host v5p compiles here like a 4-chip one; it needs libtpu
(`pip install "jax[tpu]"`, or `make setup`, which unpacks it to `.venv/libtpu`).

Chip figures (peak dense bf16 FLOP/s, HBM capacity and bandwidth, ICI bandwidth per chip) are Google Cloud's published ones:
https://cloud.google.com/tpu/docs/v4, .../v5e, .../v5p, .../v6e (read 2026-12-01). The HBM capacity is the
documented one; the runtime keeps a little of it for itself, so a program within a few hundred MiB of it may
still not load. The ICI links (ports per chip, bytes/s one way per link, which axes close into a ring) are the
scaling book's (jax-ml/scaling-book, tpus.md, "TPU Networking"; read 2026-12-07) and feed the forecast's collective
model (`minpro_jax.aot.links`). GPU generations (H100, H200, A100: NVIDIA's product pages) describe the machine
`local_slice` finds, for `benchmarks/device_step.py`; they cannot be compiled for from a CPU.
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
  # bytes/s one chip receives over ICI with every link busy (the roofline's ICI rate; the documented per-chip figure)
  ici_bytes_per_s: float = 0.0
  ici_link_bytes_per_s: float = 0.0  # one link, one way (the forecast's; scaling book tpus.md, NVLink for GPUs)
  ici_ports: int = 0  # links per chip: 6 on a 3D torus, 4 on a 2D one
  platform: str = "tpu"  # "tpu", "gpu" or "cpu"
  host_bytes_per_s: float = 0.0  # one way between the chip and its host's memory (PCIe), for offloaded activations


# ICI, roofline: the documented per-chip interconnect figures (v4 2,400 Gbps = 300 GB/s, v5e 1,600 Gbps = 200 GB/s,
# v5p 4,800 Gbps = 600 GB/s; v6e 800 GB/s bidirectional, taken as 400), as bytes/s one chip receives with every link
# busy (the scaling book's per-link figures agree within 10 %: v5p 6 links x 90 GB/s one way = 540 GB/s).
# ICI, forecast: one way per link, v4 and v5e 45 GB/s, v5p and v6e 90 GB/s (scaling book tpus.md, the ICI table).
# Host (PCIe) per chip: "typically around 1.5e10 bytes / second", v6e 32 GB/s (scaling book tpus.md); GPUs: PCIe Gen5
# x16 64 GB/s one way (H100, H200), Gen4 32 GB/s (A100).
_BOOK = "; ICI links: https://jax-ml.github.io/scaling-book/tpus/"
_GCP = "https://cloud.google.com/tpu/docs/"
# fmt: off
CHIPS = {
    "v4": Chip("v4", 32 * GIB, 275e12, 1228e9, 2, (2, 2, 1), 3, _GCP + "v4" + _BOOK, 300e9, 45e9, 6,
                host_bytes_per_s=15e9),
    "v5e": Chip("v5e", 16 * GIB, 197e12, 819e9, 1, (2, 4, 1), 2, _GCP + "v5e" + _BOOK, 200e9, 45e9, 4,
                host_bytes_per_s=15e9),
    "v5p": Chip("v5p", 95 * GIB, 459e12, 2765e9, 2, (2, 2, 1), 3, _GCP + "v5p" + _BOOK, 600e9, 90e9, 6,
                host_bytes_per_s=15e9),
    "v6e": Chip("v6e", 32 * GIB, 918e12, 1640e9, 1, (2, 4, 1), 2, _GCP + "v6e" + _BOOK, 400e9, 90e9, 4,
                host_bytes_per_s=32e9),
}
# GPUs (SXM unless named): dense bf16 (half the datasheets' "with sparsity" figure), HBM, NVLink 900 GB/s (H100, H200)
# or 600 GB/s (A100) bidirectional, i.e. 450 / 300 GB/s one way per GPU through NVSwitch (one hop to any GPU of a node).
_NV = "https://www.nvidia.com/en-us/data-center/"
GPUS = {
    "h100": Chip("h100", 80 * 10**9, 989e12, 3350e9, 1, (8, 1, 1), 1, _NV + "h100/", 450e9, 450e9, 1, "gpu",
                host_bytes_per_s=64e9),
    "h100-pcie": Chip("h100-pcie", 80 * 10**9, 756e12, 2000e9, 1, (8, 1, 1), 1, _NV + "h100/", 300e9, 300e9, 1, "gpu",
                host_bytes_per_s=64e9),
    "h200": Chip("h200", 141 * 10**9, 989e12, 4800e9, 1, (8, 1, 1), 1, _NV + "h200/", 450e9, 450e9, 1, "gpu",
                host_bytes_per_s=64e9),
    "a100-80gb": Chip("a100-80gb", 80 * 10**9, 312e12, 2039e9, 1, (8, 1, 1), 1, _NV + "a100/", 300e9, 300e9, 1, "gpu",
                host_bytes_per_s=32e9),
    "a100-40gb": Chip("a100-40gb", 40 * 10**9, 312e12, 1555e9, 1, (8, 1, 1), 1, _NV + "a100/", 300e9, 300e9, 1, "gpu",
                host_bytes_per_s=32e9),
}
# fmt: on
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
_CPU = Chip("cpu", 0, 0.0, 0.0, 1, (1, 1, 1), 1, "virtual CPU devices (no memory limit, no peaks)", platform="cpu")


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
    return self.chip.platform == "tpu"

  @property
  def dims(self) -> tuple[int, ...]:
    """Chips along each physical axis (`v5p:2x4x4` -> (2, 4, 4)); (num_chips,) for CPU and GPU slices."""
    shape = self.topology.split(":", 1)[1]
    return tuple(int(d) for d in shape.split("x")) if "x" in shape else (self.num_chips,)

  @property
  def wraparound(self) -> tuple[bool, ...]:
    """Which physical axes close into a ring. 3D slices (v4, v5p) get their wraparound links from the optical
    switches of full 4x4x4 cubes: every axis wraps when every dimension is a multiple of 4, none otherwise (a 2x4x4
    v5p-64 has none); 2D slices (v5e, v6e) wrap an axis of 16 chips (scaling book, tpus.md). GPUs: none (switched)."""
    d = self.dims
    if not self.is_tpu:
      return (False,) * len(d)
    if self.chip.dims == 3:
      return (all(n % 4 == 0 for n in d),) * len(d)
    return tuple(n == 16 for n in d)

  def devices(self) -> list:
    """The slice's devices (TPU: abstract, compile-only; cpu:N: this process's first N CPU devices).

    Raises:
      ConfigError: `cpu:N` with fewer than N CPU devices in this process (set
        `XLA_FLAGS=--xla_force_host_platform_device_count=N` before JAX starts), or libtpu not importable.
    """
    import jax

    if self.chip.platform == "gpu":
      return jax.devices()[: self.num_chips]
    if not self.is_tpu:
      cpus = jax.devices("cpu")
      if len(cpus) < self.num_chips:
        raise ConfigError(
            f"--topology={self.name}: this process has {len(cpus)} CPU devices; start it with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={self.num_chips} (python -m minpro_jax.aot does)"
        )
      return cpus[: self.num_chips]
    # heavy import (JAX, the model): only to build a TPU topology's devices; parsing a slice needs none
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
    ConfigError: an unknown generation or a size without a standard shape, naming `--topology` and the choices;
      `cpu:N` with N < 1.
  """
  m = re.fullmatch(r"cpu:(-?\d+)", name)
  if m and int(m.group(1)) > 0:
    n = int(m.group(1))
    return Slice(name, _CPU, n, f"cpu:{n}", (n, 1, 1))
  if m:
    raise ConfigError(f"--topology={name}: cpu:N takes N >= 1 virtual CPU devices (e.g. cpu:8)")
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


def local_slice() -> Slice:
  """The slice of the devices JAX finds here: a TPU (its generation from `device_kind`), a GPU generation of `GPUS`
  (from the device kind: "H100", "H200", "A100 ... 40GB"), or `cpu:N`; chips = the local devices.

  Raises:
    ConfigError: a GPU or TPU whose kind has no entry here, naming it and the known ones.
  """
  import jax

  devices = jax.devices()
  kind, n = devices[0].device_kind, len(devices)
  platform = devices[0].platform
  if platform == "cpu":
    return parse_slice(f"cpu:{n}")
  k = kind.lower().replace(" ", "")
  if platform == "gpu":
    key = next((g for g in ("h200", "h100", "a100") if g in k), None)
    if key == "h100" and "pcie" in k:
      key = "h100-pcie"
    elif key == "a100":
      key = "a100-40gb" if "40gb" in k else "a100-80gb"
    if key is None:
      raise ConfigError(f"local device kind {kind!r}: no figures for it; known GPUs: {sorted(GPUS)}")
    return Slice(f"{key}:{n}", GPUS[key], n, f"{key}:{n}", (n, 1, 1))
  gen = next((g for g, tag in (("v6e", "v6"), ("v5e", "v5lite"), ("v5p", "v5"), ("v4", "v4")) if tag in k), None)
  if gen is None:
    raise ConfigError(f"local device kind {kind!r}: no figures for it; known TPUs: {sorted(CHIPS)}")
  chip = CHIPS[gen]
  shapes = SHAPES_3D if chip.dims == 3 else SHAPES_2D
  dims = shapes.get(n, (n,) + (1,) * (chip.dims - 1))
  per_host = tuple(min(d, h) for d, h in zip(dims + (1,) * (3 - len(dims)), chip.chips_per_host))
  return Slice(f"{gen}-{n * chip.cores_per_chip}", chip, n, f"{gen}:{'x'.join(map(str, dims))}", per_host)
