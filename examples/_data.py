"""Fashion-MNIST for the examples: where to find it, and an IDX (.gz) reader.

Search order (:func:`resolve_data_dir`): ``--data-dir``, ``$QTRAIN_DATA_DIR``,
``shared/data/fashion-mnist`` next to the repository, Debian's
``/usr/share/datasets/fashion-mnist``; a folder counts if it holds the four IDX files
(``{train,t10k}-{images-idx3,labels-idx1}-ubyte``, gzip-compressed or plain), as in
https://github.com/zalandoresearch/fashion-mnist/tree/master/data/fashion.

IDX: a big-endian header - two zero bytes, a type byte (0x08 = uint8), the
number of dimensions - then one big-endian uint32 per dimension, then the
data. Files may be gzip-compressed (``*.gz``) or plain.
"""

from __future__ import annotations

import gzip
import os

import numpy as np

ENV_VAR = "QTRAIN_DATA_DIR"
# ``shared/data/fashion-mnist`` next to the repository (``<repo root>/../shared/...``).
SHARED_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))), "shared", "data", "fashion-mnist")
DEBIAN_DIR = "/usr/share/datasets/fashion-mnist"  # Debian's dataset-fashion-mnist package
DOWNLOAD_URL = "https://github.com/zalandoresearch/fashion-mnist/tree/master/data/fashion"
STEMS = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
         "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")

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


class DataNotFoundError(FileNotFoundError):
  """No searched folder holds the four IDX files; the message says where it looked."""


def candidate_dirs(data_dir: str | None = None) -> list[tuple[str, str | None]]:
  """``(where, folder)`` in search order: ``data_dir`` (``--data-dir``), ``$QTRAIN_DATA_DIR``,
  :data:`SHARED_DIR`, :data:`DEBIAN_DIR`; ``folder`` is None where the flag or variable is unset."""
  return [("--data-dir", data_dir or None), (f"${ENV_VAR}", os.environ.get(ENV_VAR) or None),
          ("next to the repository", SHARED_DIR), ("Debian's dataset-fashion-mnist", DEBIAN_DIR)]


def _missing(d: str) -> list[str]:
  """The stems of :data:`STEMS` that folder ``d`` lacks (plain or ``.gz``)."""
  return [s for s in STEMS if not any(os.path.isfile(os.path.join(d, s + e)) for e in (".gz", ""))]


def resolve_data_dir(data_dir: str | None = None) -> str:
  """The first folder of :func:`candidate_dirs` that holds all four IDX files.

  Raises :class:`DataNotFoundError` naming every place searched and where to download the
  files. A folder named by ``--data-dir`` or ``$QTRAIN_DATA_DIR`` that lacks them is reported
  on stdout before the search goes on.
  """
  lines = []
  for where, d in candidate_dirs(data_dir):
    if d is None:
      lines.append(f"  {where:<32} (not set)")
      continue
    if not os.path.isdir(d):
      why = "no such folder"
    else:
      missing = _missing(d)
      if not missing:
        return d
      why = "lacks " + ", ".join(m + "[.gz]" for m in missing)
    lines.append(f"  {where:<32} {d}: {why}")
    if where.startswith(("--", "$")):
      print(f"Fashion-MNIST: {where} {d}: {why}; searching on", flush=True)
  raise DataNotFoundError(
      "Fashion-MNIST not found. Searched, in this order, for the four IDX files ("
      + ", ".join(s + "[.gz]" for s in STEMS) + "):\n" + "\n".join(lines) + "\n"
      "Download the four .gz files (zalandoresearch/fashion-mnist on GitHub, folder data/fashion)\n"
      f"  {DOWNLOAD_URL}\n"
      f"into a folder and pass --data-dir <folder> or set {ENV_VAR}=<folder>\n"
      "(on Debian: apt install dataset-fashion-mnist).")


def load_mnist_like(data_dir: str):
  """Returns ``(x_train, y_train, x_test, y_test)``: uint8 (n, 28, 28) images, uint8 labels."""
  xs = {}
  for split, prefix in (("train", "train"), ("test", "t10k")):
    xs[split] = (read_idx(_find(data_dir, f"{prefix}-images-idx3-ubyte")),
                 read_idx(_find(data_dir, f"{prefix}-labels-idx1-ubyte")))
  return xs["train"][0], xs["train"][1], xs["test"][0], xs["test"][1]
