"""`ParamStore`: parameter versions keyed by `policy_version` for the sampler.

`policy_version` is the number of optimizer updates that produced the parameters (0 = initial weights).
The sampler is handed one version and stamps it on every batch it generates, so the learner always knows
which behavior policy produced a row (the delay / staleness of off-policy training is
`learner_version - batch.policy_version`).

Storing a version stores a reference to the State pytree, not a copy: JAX arrays are immutable, so
versions whose leaves were not updated share the same buffers and memory grows only by the arrays that
actually changed. Never donate a stored version's buffers to a jitted update while the version is held.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


class ParamStore:
  """Holds the last `keep_last` parameter versions.

  Args:
    keep_last: number of most recent versions kept (>= 1); older ones are evicted on `put`.

  Raises:
    ValueError: keep_last < 1.
  """

  def __init__(self, keep_last: int = 2):
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
      raise ValueError(f"keep_last must be an int >= 1, got {keep_last!r}")
    self.keep_last = keep_last
    self._versions: OrderedDict[int, Any] = OrderedDict()

  def put(self, version: int, state: Any) -> None:
    """Stores `state` (a param pytree / nnx.State) as `version`.

    Raises:
      ValueError: version is not an int >= 0, or is not newer than the latest stored version.
    """
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
      raise ValueError(f"version must be an int >= 0 (number of optimizer updates), got {version!r}")
    if self._versions and version <= self.latest_version:
      raise ValueError(f"version {version} is not newer than the latest stored version {self.latest_version}")
    self._versions[version] = state
    while len(self._versions) > self.keep_last:
      self._versions.popitem(last=False)

  def get(self, version: int) -> Any:
    """The State of `version`.

    Raises:
      KeyError: the version was never stored or has been evicted (the message lists the held versions).
    """
    try:
      return self._versions[version]
    except KeyError:
      raise KeyError(
          f"policy_version {version} is not held by the ParamStore (held versions: "
          f"{self.versions}; keep_last={self.keep_last}); it was evicted or never stored"
      ) from None

  @property
  def latest_version(self) -> int:
    """The newest stored version. Raises LookupError when the store is empty."""
    if not self._versions:
      raise LookupError("the ParamStore is empty; put(version, state) first")
    return next(reversed(self._versions))

  def latest(self) -> tuple[int, Any]:
    """(latest_version, its State)."""
    v = self.latest_version
    return v, self._versions[v]

  @property
  def versions(self) -> list[int]:
    """Held versions, oldest first."""
    return list(self._versions)

  def __contains__(self, version: int) -> bool:
    return version in self._versions

  def __len__(self) -> int:
    return len(self._versions)
