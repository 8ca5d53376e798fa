"""IDX (.gz) reader for MNIST-format datasets such as Fashion-MNIST.

IDX: a big-endian header - two zero bytes, a type byte (0x08 = uint8), the
number of dimensions - then one big-endian uint32 per dimension, then the
data. Files may be gzip-compressed (``*.gz``) or plain.
"""

from __future__ import annotations

import gzip
import os

import numpy as np

DEFAULT_DIR = "/usr/share/datasets/fashion-mnist"  # Debian's dataset-fashion-mnist

_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str) -> np.ndarray:
  """Reads one IDX file (gzip or plain) into a numpy array."""
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rb") as f:
    data = f.read()
  if len(data) < 4 or data[0] != 0 or data[1] != 0:
    raise ValueError(f"{path}: not an IDX file (bad magic {data[:4]!r})")
  dtype, ndim = data[2], data[3]
  if dtype not in _DTYPES:
    raise ValueError(f"{path}: unknown IDX type byte 0x{dtype:02x}")
  dims = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
  arr = np.frombuffer(data, dtype=_DTYPES[dtype], offset=4 + 4 * ndim)
  if arr.size != int(np.prod(dims)):
    raise ValueError(f"{path}: header says {dims} but holds {arr.size} values")
  return arr.reshape(dims).astype(np.dtype(_DTYPES[dtype]).newbyteorder("="))


def _find(data_dir: str, stem: str) -> str:
  for name in (stem + ".gz", stem):
    p = os.path.join(data_dir, name)
    if os.path.exists(p):
      return p
  raise FileNotFoundError(f"{stem}[.gz] not found in {data_dir}")


def resolve_data_dir(data_dir: str | None) -> str:
  """``data_dir`` (default :data:`DEFAULT_DIR`) if it holds the IDX files; else a clear error."""
  d = data_dir or DEFAULT_DIR
  if os.path.isdir(d):
    try:
      _find(d, "train-images-idx3-ubyte")
      return d
    except FileNotFoundError:
      pass
  raise FileNotFoundError(
      f"no Fashion-MNIST IDX files (train-images-idx3-ubyte[.gz], ...) in --data_dir={d!r}; "
      "install Debian's dataset-fashion-mnist or point --data_dir at a folder holding them")


def load_mnist_like(data_dir: str):
  """Returns ``(x_train, y_train, x_test, y_test)``: uint8 (n, 28, 28) images, uint8 labels."""
  xs = {}
  for split, prefix in (("train", "train"), ("test", "t10k")):
    xs[split] = (read_idx(_find(data_dir, f"{prefix}-images-idx3-ubyte")),
                 read_idx(_find(data_dir, f"{prefix}-labels-idx1-ubyte")))
  return xs["train"][0], xs["train"][1], xs["test"][0], xs["test"][1]
