"""Math problems from a prepared TFDS dataset (array_record files), read without TensorFlow and without the builder.

A dataset written by ``python -m minpro_jax.data.build_tfds`` (``minpro_jax.data.build_tfds.build_dataset``) lives in
``DATA_DIR/NAME/VERSION/`` as ``NAME-SPLIT.array_record-*`` shards plus ``dataset_info.json`` and ``features.json``.
``load_tfds`` opens it with ``tfds.data_source(NAME, split=SPLIT, data_dir=DATA_DIR)``, which needs only those
files (no builder class is imported), so a dataset prepared once can be read by every host from a shared folder or
a ``gs://`` bucket.

Features of every example (``FEATURES``): ``index`` (int64, the row's position in its split, which restores the
source file order), ``id``, ``prompt``, ``answer``, ``source`` (text) and ``metadata`` (a JSON object as text).

References: ``data.source = "tfds"`` with ``data.tfds_name``, ``data.tfds_split``, ``data.tfds_data_dir``; and in
``eval.path`` an item ``NAME=tfds:DATASET/SPLIT@DATA_DIR`` (``parse_tfds_ref``).
"""

from __future__ import annotations

import json
import os

from minpro_jax.data.records import DataError, MathProblem
from minpro_jax.errors import ConfigError

FEATURES = ("index", "id", "prompt", "answer", "source", "metadata")


def _text(v) -> str:
  return v.decode("utf-8") if isinstance(v, bytes) else str(v)


def parse_tfds_ref(ref: str) -> tuple[str, str, str]:
  """``"DATASET/SPLIT@DATA_DIR"`` -> (dataset, split, data_dir); the part after ``tfds:`` in ``eval.path``.

  ``DATA_DIR`` is a local folder or a ``gs://`` URL (everything after the first ``@``).

  Raises:
    ConfigError: naming ``config.eval.path`` when a part is missing.
  """
  head, at, data_dir = ref.partition("@")
  name, slash, split = head.partition("/")
  if not (at and slash and name and split and data_dir):
    raise ConfigError(f"config.eval.path: tfds:{ref!r}; write NAME=tfds:DATASET/SPLIT@DATA_DIR")
  return name, split, data_dir


def dataset_dir_exists(name: str, data_dir: str) -> bool:
  """True when ``data_dir/name`` exists; always True for a remote (``scheme://``) data_dir, which is not probed."""
  if "://" in data_dir:
    return True
  return os.path.isdir(os.path.join(data_dir, name))


def load_tfds(name: str, split: str, data_dir: str, *, limit: int | None = None) -> list[MathProblem]:
  """The problems of split ``split`` of the prepared TFDS dataset ``name`` under ``data_dir``, in source order.

  Args:
    name: the dataset name given to ``build_tfds`` (e.g. ``"my_math"``).
    split: a split name (``"train"``, ``"test"``) or any TFDS split expression (``"train[:100]"``).
    data_dir: the folder (or ``gs://`` URL) that holds ``name/``.
    limit: keep only the first ``limit`` problems (by ``index``).

  Returns:
    ``MathProblem`` list sorted by the stored ``index`` (the order of the file the split was built from).

  Raises:
    DataError: the dataset or split cannot be opened, or a row lacks a feature of ``FEATURES``.
  """
  import tensorflow_datasets as tfds

  try:
    ds = tfds.data_source(name, split=split, data_dir=data_dir)
  except Exception as e:  # noqa: BLE001  (tfds raises DatasetNotFoundError, ValueError, FileNotFoundError, ...)
    raise DataError(f"tfds dataset {name!r} split {split!r} in {data_dir!r} cannot be opened: {e}") from e
  rows = [ds[i] for i in range(len(ds))]
  missing = [k for k in FEATURES if rows and k not in rows[0]]
  if missing:
    raise DataError(
        f"tfds dataset {name!r}: examples lack features {missing}; build it with minpro_jax.data.build_tfds"
    )
  rows.sort(key=lambda r: int(r["index"]))
  if limit is not None:
    rows = rows[:limit]
  return [
      MathProblem(
          id=_text(r["id"]),
          prompt=_text(r["prompt"]),
          answer=_text(r["answer"]),
          source=_text(r["source"]),
          metadata=json.loads(_text(r["metadata"]) or "{}"),
      )
      for r in rows
  ]
