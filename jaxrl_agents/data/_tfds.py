"""The base of the project's TFDS builders: array_record files, no TensorFlow, no downloads."""

from __future__ import annotations

from typing import Any

import tensorflow_datasets as tfds


class ArrayRecordBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """A GeneratorBasedBuilder that writes array_record unless told otherwise.

  TFDS's default file format, tfrecord, is written with TensorFlow; array_record
  is not, and it reads back as a random-access data source. Defaulting here makes
  `tfds.data_source("arithmetic/add1")` and `tfds.builder(...)` work without
  TensorFlow too, not only `jaxrl_agents.data.load_task`.
  """

  # Nothing is downloaded, so there are no URL checksums to look up. Saying so also
  # skips TFDS 4.9's lookup of a checksums file next to the module, which imports
  # `importlib_resources`, a package TFDS declares only for Python < 3.9.
  url_infos = None

  def __init__(self, *, file_format: str | None = None, **kwargs: Any):
    super().__init__(file_format=file_format or "array_record", **kwargs)
