"""The forecast's constants: kernel efficiencies, latencies and floors, each a band with its source.

A `Band` holds the value the forecast uses at each of its three levels: "low" (the shortest time: the best published
figure), "central" and "high" (the longest). A forecast is the compiled program's bytes and FLOPs (the roofline's
inputs, `minpro_jax.aot.hlo_cost`) taken at these efficiencies, plus latencies the roofline leaves out
(`minpro_jax.aot.forecast`, docs/aot.md "The forecast"). Sources are quoted as read on 2026-12-07; a value marked
"assumption" has no published figure behind it and says what it rests on. None was fitted to the calibration table
(benchmarks/results/aot/calibration.json): they were set from these sources first, and the table checks them.

Host costs (detokenising and grading a response on a CPU) are measured here by `benchmarks/host_cost.py`
(benchmarks/results/host_cost.json).
"""

from __future__ import annotations

import dataclasses

import numpy as np

LEVELS = ("low", "central", "high")
SCALING_BOOK = "https://jax-ml.github.io/scaling-book"
RPA = "Ragged Paged Attention (arXiv 2604.15464): up to 86 % of HBM bandwidth in decode, 73 % MFU in prefill, TPU7x"


@dataclasses.dataclass(frozen=True)
class Band:
  """One constant at the forecast's three levels (`LEVELS`: the values that give the low, central and high time),
  its unit and its source."""

  low: float
  central: float
  high: float
  unit: str
  source: str

  def values(self) -> np.ndarray:
    """[low, central, high] as a float array (the forecast computes its three levels at once)."""
    return np.array([self.low, self.central, self.high], dtype=np.float64)

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Constants:
  """Every constant of one platform's forecast (fields below); `as_dict` for the report."""

  mxu: Band  # share of peak FLOP/s a compute-bound matmul reaches
  attention: Band  # share of peak FLOP/s of the attention kernels whose FLOPs the HLO cannot see (Pallas custom calls)
  hbm: Band  # share of HBM bandwidth a memory-bound XLA op (fusion, copy, scatter) reaches
  matmul_hbm: Band  # share of HBM bandwidth a memory-bound matmul (small batch: decode's weights) reaches
  paged_attention: Band  # share of HBM bandwidth the paged attention kernel reaches on its KV pages
  op_floor: Band  # seconds every fusion, copy or kernel takes at least (launch, pipeline fill, DMA latency)
  hop_latency: Band  # seconds per ICI hop of a collective
  collective_overhead: Band  # fixed seconds per collective (dispatch, synchronisation)
  link_efficiency: Band  # share of the link rate a bandwidth-bound collective reaches
  host_scale: Band  # multiplies the measured per-response host costs (another host CPU than the one measured)

  def as_dict(self) -> dict:
    return {f.name: getattr(self, f.name).as_dict() for f in dataclasses.fields(self)}


_HOST_SCALE = Band(
    0.5,
    1.0,
    2.0,
    "x measured",
    "assumption: a TPU/GPU host's core is up to 2x faster or slower "
    "than the loaded 2-core AMD EPYC the costs were measured on (one core: grading runs in the main thread)",
)

TPU = Constants(
    mxu=Band(
        0.90,
        0.85,
        0.80,
        "of peak FLOP/s",
        "jax Pallas TPU matmul guide (docs.jax.dev/en/latest/pallas/tpu/matmul.html): bf16 matmuls of 1k-8k reach "
        "'pretty good utilization (80-90%)' of v5e peak, XLA's own jnp.matmul alike",
    ),
    attention=Band(
        0.73,
        0.60,
        0.45,
        "of peak FLOP/s",
        f"low: {RPA} (prefill); central and high: assumption, the splash kernels' backward below the forward",
    ),
    hbm=Band(
        0.92,
        0.86,
        0.75,
        "of HBM bandwidth",
        f"central: {RPA} (the best published TPU memory-bound kernel); low and high: assumption",
    ),
    matmul_hbm=Band(
        0.95,
        0.86,
        0.75,
        "of HBM bandwidth",
        f"low: {SCALING_BOOK}/tpus/ ('at small batch sizes, this [the weight-loading bound] is close to being "
        f"achievable'); central: {RPA} (decode MBU); high: assumption",
    ),
    paged_attention=Band(
        0.86,
        0.75,
        0.60,
        "of HBM bandwidth",
        f"low: {RPA}; central and high: assumption for jax's older pallas.ops.tpu paged_attention "
        "(one block of pages per grid step, no ragged tiling) that this code runs",
    ),
    op_floor=Band(
        0.5e-6,
        1.0e-6,
        2.0e-6,
        "s per op",
        "assumption: an HBM->VMEM DMA round trip and the kernel's pipeline fill and drain, ~1 us; no published "
        "TPU per-op figure found (searched the scaling book, jax and XLA docs)",
    ),
    hop_latency=Band(
        1e-6,
        1e-6,
        1e-6,
        "s per hop",
        f"{SCALING_BOOK}/sharding/ ('A note on ICI latency': 'typically " "around 1us' per hop)",
    ),
    collective_overhead=Band(
        0.0,
        5e-6,
        10e-6,
        "s per collective",
        f"{SCALING_BOOK}/sharding/ (worked problem: a 3-hop latency-bound AllGather, predicted "
        "3 us from hops alone (low), 'in practice, it's closer to 8us' (central: 8 - 3 hops); high: "
        "assumption, twice the central",
    ),
    link_efficiency=Band(
        1.0,
        0.82,
        0.70,
        "of the link rate",
        f"{SCALING_BOOK}/sharding/ (worked problem: a bandwidth-bound AllGather predicted 560 us, "
        "profiled 680 us: 0.82, central); low: the link rate; high: assumption",
    ),
    host_scale=_HOST_SCALE,
)

GPU = Constants(
    mxu=Band(
        0.79,
        0.70,
        0.60,
        "of peak FLOP/s",
        "low: H100 SXM bf16 torch.mm 4224x8192x2048 at 780 TFLOP/s of 989 (gist.github.com/Chillee/"
        "2ec89696db8b7ed1c24461159e325405); central and high: assumption (XLA's own GEMMs, smaller shapes)",
    ),
    attention=Band(0.60, 0.45, 0.35, "of peak FLOP/s", "assumption: cuDNN flash attention on Hopper"),
    hbm=Band(0.90, 0.80, 0.70, "of HBM bandwidth", "assumption: XLA:GPU elementwise fusions reach 70-90 % of HBM"),
    matmul_hbm=Band(0.90, 0.80, 0.70, "of HBM bandwidth", "assumption: as `hbm`"),
    paged_attention=Band(
        0.80,
        0.65,
        0.50,
        "of HBM bandwidth",
        "assumption: the plain-JAX paged attention (gather of the row's pages, then attention)",
    ),
    op_floor=Band(
        2e-6,
        4e-6,
        8e-6,
        "s per op",
        "assumption: a CUDA kernel launch and its tail, 2-8 us; XLA:GPU command buffers shorten it",
    ),
    hop_latency=Band(1e-6, 2e-6, 3e-6, "s per hop", "assumption: one NVSwitch hop"),
    collective_overhead=Band(5e-6, 10e-6, 20e-6, "s per collective", "assumption: NCCL launch and synchronisation"),
    link_efficiency=Band(0.90, 0.80, 0.70, "of the link rate", "assumption: NCCL on NVLink"),
    host_scale=_HOST_SCALE,
)


def constants_for(platform: str) -> Constants | None:
  """The `Constants` of a platform ("tpu", "gpu"); None for "cpu" (no peaks: no forecast)."""
  return {"tpu": TPU, "gpu": GPU}.get(platform)


# Host costs per response on the CPU the trainer grades on, measured by benchmarks/host_cost.py on 2026-12-07 (AMD
# EPYC, 2 cores shared with a long study; benchmarks/results/host_cost.json): detokenising one response (a byte-level
# BPE of the `tokenizers` library, SmolLM2's 49k vocabulary standing in for Qwen3's 152k) and grading it in each
# reward mode, as seconds = a + b x response tokens.
HOST_COST = {
    "detokenize": (7.85e-06, 1.11e-07),
    "integer": (2.76e-05, 5.41e-10),
    "math": (0.000282, 6.93e-10),
}
HOST_COST_SOURCE = "benchmarks/results/host_cost.json (benchmarks/host_cost.py, 2026-12-07, AMD EPYC 2 cores, loaded)"


def host_seconds_per_response(mode: str, tokens: float) -> tuple[float, str]:
  """(seconds one process spends detokenising and grading one response of `tokens` tokens in reward `mode`, the
  mode the cost was measured for: `mode` itself, or "math" (the slowest) for a mode not measured)."""
  used = mode if mode in HOST_COST else "math"
  a_d, b_d = HOST_COST["detokenize"]
  a_g, b_g = HOST_COST[used]
  return a_d + b_d * tokens + a_g + b_g * tokens, used
