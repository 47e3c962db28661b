"""The split of a run's devices between the sampler and the learner (`config.sampling.devices`).

With a split, the sampler's layout (`inference_mesh.sampler_layout`) spans its own devices and the learner's mesh
(`config.mesh.shape`) the rest, so that for delay >= 1 a step's sampling and learning can run at the same time
(`minpro_jax.run.step_runner`). Without one (0, the default) both span every device, one after the other.

Which devices: the same share of every process's devices, the last ones of each process in `jax.devices()` order,
go to the sampler; so every process would hold devices of both sides and, on one process, the learner keeps device 0
(the default device, where a run without `mesh.shape` puts it). A run of several processes cannot split yet: JAX
0.10.2 moves a multi-process array only within its device set (`jax.device_put` raises "For a cross-host reshard in
multi-controller JAX, input and target sharding should have the same set of devices"; TPU's TFRT runtime aside).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import jax

from minpro_jax.errors import ConfigError


class DeviceSplit(NamedTuple):
  """The devices of each side, each in `jax.devices()` order."""

  sampler: tuple[jax.Device, ...]
  learner: tuple[jax.Device, ...]


def sampler_device_count(value, num_devices: int, process_count: int = 1) -> int:
  """The sampler's device count of `config.sampling.devices` (0: no split).

  Args:
    value: 0 (no split: sampler and learner share every device), an int count in [1, num_devices), or a fraction in
      (0, 1) of the devices (rounded to the nearest count).
    num_devices: the run's devices, all processes together.
    process_count: the run's processes (a split needs one today).

  Raises:
    ConfigError: naming `config.sampling.devices`: not an int or a float, a count that leaves the learner or the
      sampler no device, a split in a run of several processes.
  """
  field = "config.sampling.devices"
  if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
    raise ConfigError(f"{field}: must be 0 (no split), a device count or a fraction in (0, 1), got {value!r}")
  if isinstance(value, float) and not value.is_integer():
    if not 0 < value < 1:
      raise ConfigError(f"{field}: a fraction of the devices must lie in (0, 1), got {value}")
    count = math.floor(value * num_devices + 0.5)  # the nearest count, halves up
    what = f"{value} of {num_devices} devices = {count}"
  else:
    count = int(value)
    what = f"{count} of {num_devices} devices"
  if count == 0 and value == 0:
    return 0
  if num_devices < 2:
    raise ConfigError(f"{field}: a split needs at least 2 devices, this run has {num_devices}; use 0 (no split)")
  if not 1 <= count < num_devices:
    raise ConfigError(
        f"{field}: {what} leaves the {'sampler' if count < 1 else 'learner'} no device; give the sampler between 1 "
        f"and {num_devices - 1} of the {num_devices} devices (or 0: sampler and learner share every device)"
    )
  if process_count > 1:  # jax 0.10.2: "a cross-host reshard ... should have the same set of devices"
    raise ConfigError(
        f"{field}: a run of {process_count} processes cannot split its devices yet: the weight transfer moves the "
        "learner's parameters onto other devices, which multi-controller JAX does only within one device set "
        "(TPU's TFRT runtime aside); use sampling.devices=0 (the sampler's own layout over every device: "
        "sampling.mesh), or one process"
    )
  return count


def split_devices(count: int, devices: Sequence[jax.Device] | None = None) -> DeviceSplit | None:
  """The `DeviceSplit` giving the sampler `count` of `devices` (default `jax.devices()`): the last count / P of
  each of the P processes' devices; None for `count` 0.

  Raises:
    ValueError: a count the processes' devices cannot give evenly (`sampler_device_count` checks the config).
  """
  if not count:
    return None
  devices = list(jax.devices() if devices is None else devices)
  by_process: dict[int, list[jax.Device]] = {}
  for d in devices:
    by_process.setdefault(d.process_index, []).append(d)
  per, rest = divmod(count, len(by_process))
  if rest or any(not 0 < per < len(ds) for ds in by_process.values()):
    raise ValueError(f"{count} sampler devices do not split evenly over the processes' devices {by_process}")
  sampler = {d.id for ds in by_process.values() for d in ds[-per:]}
  return DeviceSplit(
      sampler=tuple(d for d in devices if d.id in sampler), learner=tuple(d for d in devices if d.id not in sampler)
  )
