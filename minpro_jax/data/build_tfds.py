"""Prepare a TFDS dataset (array_record, no TensorFlow) from local math files, once, for every host to read.

Usage::

    python -m minpro_jax.data.build_tfds --name=my_math --data_dir=/data/tfds \\
        --split=train=dapo:/data/dapo-math-17k.parquet --split=test=math500:/data/math500/test.jsonl

Each ``--split=SPLIT=FORMAT:PATH`` reads ``PATH`` with ``minpro_jax.data.sources.load_file(PATH, FORMAT)``, so every
layout the loaders know works (``dapo``, ``math500``, ``aime``, ``amc``, ``minerva``, ``olympiadbench``, ``gsm8k``,
``auto``; ``.jsonl`` / ``.json`` / ``.parquet``); ``FORMAT:`` may be left out (``auto``). Malformed rows are skipped
and logged as the loader does. The result is ``DATA_DIR/NAME/1.0.0/`` (``dataset_info.json``, ``features.json`` and
``NAME-SPLIT.array_record-*``), read back with ``minpro_jax.data.tfds_source.load_tfds`` or
``tfds.data_source(NAME, split=SPLIT, data_dir=DATA_DIR)`` in any process, without this builder. Copy the folder to
a bucket (``gsutil -m cp -r DATA_DIR/NAME gs://BUCKET/tfds/``) and point every host's ``data.tfds_data_dir`` at it.

Only the array_record format is written: TFDS's default tfrecord writer needs TensorFlow, which this project never
installs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Mapping, Sequence

import numpy as np

from minpro_jax.data.records import MathProblem
from minpro_jax.data.sources import FORMATS, load_file

DATASET_VERSION = "1.0.0"
_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")


def _builder_class(name: str, splits: Mapping[str, list[MathProblem]], description: str):
  import tensorflow_datasets as tfds

  class _MathBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    VERSION = tfds.core.Version(DATASET_VERSION)

    def _info(self):
      t = tfds.features.Text()
      return tfds.core.DatasetInfo(
          builder=self,
          description=description,
          features=tfds.features.FeaturesDict(
              {
                  "index": tfds.features.Scalar(dtype=np.int64),
                  "id": t,
                  "prompt": t,
                  "answer": t,
                  "source": t,
                  "metadata": t,
              }
          ),
      )

    def _split_generators(self, dl_manager):
      del dl_manager
      return {split: self._generate_examples(problems) for split, problems in splits.items()}

    def _generate_examples(self, problems):
      for i, p in enumerate(problems):
        yield f"{i:09d}", {
            "index": i,
            "id": p.id,
            "prompt": p.prompt,
            "answer": p.answer,
            "source": p.source,
            "metadata": json.dumps(p.metadata, sort_keys=True, default=str),
        }

  _MathBuilder.name = name
  return _MathBuilder


def build_dataset(name: str, splits: Mapping[str, tuple[str, str]], data_dir: str) -> str:
  """Write the TFDS dataset ``name`` under ``data_dir`` with one split per ``splits`` entry.

  Args:
    name: dataset name, lowercase snake case (``[a-z][a-z0-9_]*``), the ``data.tfds_name`` to read it with.
    splits: ``{split: (fmt, path)}``: each split is ``load_file(path, fmt)`` (fmt one of ``sources.FORMATS``).
    data_dir: output folder (local, or a ``gs://`` URL when the TFDS file system can write there).

  Returns:
    The dataset's versioned folder, ``data_dir/name/1.0.0``.

  Raises:
    ValueError: a bad name, no splits, an unknown fmt, or a split that holds no usable problem.
    FileNotFoundError: a missing input file.
  """
  if not _NAME_RE.match(name):
    raise ValueError(f"dataset name {name!r} must be lowercase snake case ([a-z][a-z0-9_]*)")
  if not splits:
    raise ValueError("give at least one split (SPLIT=FORMAT:PATH)")
  problems: dict[str, list[MathProblem]] = {}
  for split, (fmt, path) in splits.items():
    if fmt not in FORMATS:
      raise ValueError(f"split {split!r}: fmt={fmt!r}; expected one of {FORMATS}")
    problems[split] = load_file(path, fmt)
    if not problems[split]:
      raise ValueError(f"split {split!r}: {path!r} holds no usable problem in format {fmt!r}")
  desc = "minpro_jax math problems built from " + ", ".join(f"{s}={f}:{p}" for s, (f, p) in splits.items())
  builder = _builder_class(name, problems, desc)(data_dir=data_dir, file_format="array_record")
  builder.download_and_prepare()
  return str(builder.data_dir)


def parse_split(spec: str) -> tuple[str, tuple[str, str]]:
  """``"SPLIT=FORMAT:PATH"`` or ``"SPLIT=PATH"`` -> (split, (fmt, path)). Raises ValueError on a bad spec."""
  split, eq, rest = spec.partition("=")
  if not (eq and split and rest):
    raise ValueError(f"--split={spec!r}; write SPLIT=FORMAT:PATH (e.g. train=dapo:/data/dapo-math-17k.parquet)")
  fmt, colon, path = rest.partition(":")
  if not colon or fmt not in FORMATS:
    fmt, path = "auto", rest
  return split, (fmt, path)


def main(argv: Sequence[str] | None = None) -> int:
  ap = argparse.ArgumentParser(prog="python -m minpro_jax.data.build_tfds", description=__doc__.split("\n")[0])
  ap.add_argument("--name", required=True, help="dataset name (data.tfds_name)")
  ap.add_argument("--data_dir", required=True, help="output folder (data.tfds_data_dir)")
  ap.add_argument("--split", action="append", required=True, help="SPLIT=FORMAT:PATH, repeatable")
  args = ap.parse_args(argv)
  splits = dict(parse_split(s) for s in args.split)
  for fmt, path in splits.values():
    if not os.path.isfile(path):
      ap.error(f"no data file at {path!r}")
  out = build_dataset(args.name, splits, args.data_dir)
  print(f"wrote {out}: splits {sorted(splits)}; read with data.source=tfds data.tfds_name={args.name}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
