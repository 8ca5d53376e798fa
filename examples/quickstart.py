"""qtrain quickstart: the same Flax model trained in float, int8 QT and binary.

Run (CPU, no download, well under 2 minutes):

    python examples/quickstart.py                 # 1000 steps per run
    python examples/quickstart.py --steps 200 --runs float,int8 --out-dir /tmp/qs

Data: procedurally generated 10x10 images of the digits 0-9 (a 5x7 pixel
font, randomly shifted, thickened and corrupted with noise), 10 classes.
Model: a linen MLP, ``Dense -> LayerNorm -> hardtanh`` x3 -> ``Dense``.

Three runs, one model definition, three rule lists:

* ``float``: the model as written.
* ``int8``: every matmul in int8 (weights, activations, and the gradients of
  the backward, with stochastic rounding keyed by the ``"quant"`` RNG stream).
* ``binary``: the hidden layers with 1-bit weights and 1-bit activations
  (learned activation scale with bitorch-engine's gradient, clipped STE),
  first and last layers in int8 (the usual binary-network recipe).

Prints a table and writes ``results.json`` and ``loss.png`` to ``--out-dir``
(default ``<system temp dir>/qtrain_quickstart``, e.g. ``/tmp/qtrain_quickstart``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state
from tqdm import tqdm

try:
  import qtrain
except ImportError:  # run from a checkout without `pip install -e .`
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  import qtrain

# ---------------------------------------------------------------------------
# Data: procedurally generated digits.

_FONT = {
    0: ["01110", "10001", "10011", "10101", "11001", "10001", "01110"],
    1: ["00100", "01100", "00100", "00100", "00100", "00100", "01110"],
    2: ["01110", "10001", "00001", "00010", "00100", "01000", "11111"],
    3: ["11111", "00010", "00100", "00010", "00001", "10001", "01110"],
    4: ["00010", "00110", "01010", "10010", "11111", "00010", "00010"],
    5: ["11111", "10000", "11110", "00001", "00001", "10001", "01110"],
    6: ["00110", "01000", "10000", "11110", "10001", "10001", "01110"],
    7: ["11111", "00001", "00010", "00100", "01000", "01000", "01000"],
    8: ["01110", "10001", "10001", "01110", "10001", "10001", "01110"],
    9: ["01110", "10001", "10001", "01111", "00001", "00010", "01100"],
}
SIDE = 10


def _templates() -> tuple[np.ndarray, np.ndarray]:
  """Every digit at every position, thin and thick strokes: (T, SIDE*SIDE), labels (T,)."""
  imgs, labels = [], []
  for d in range(10):
    g = np.array([[c == "1" for c in row] for row in _FONT[d]], np.float32)
    for thick in (g, np.maximum(g, np.roll(g, 1, axis=1))):
      for dy in range(SIDE - 7 + 1):
        for dx in range(SIDE - 5 + 1):
          canvas = np.zeros((SIDE, SIDE), np.float32)
          canvas[dy:dy + 7, dx:dx + 5] = thick
          imgs.append(canvas.reshape(-1))
          labels.append(d)
  return np.stack(imgs), np.array(labels, np.int32)


def make_digits(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
  """``n`` noisy digit images (float32, flattened, 10x10) and their labels."""
  rng = np.random.default_rng(seed)
  templates, tlabels = _templates()
  idx = rng.integers(0, len(templates), n)
  imgs, labels = templates[idx], tlabels[idx]
  flips = rng.random(imgs.shape) < 0.05            # salt-and-pepper pixels
  imgs = np.where(flips, 1.0 - imgs, imgs) + 0.3 * rng.standard_normal(imgs.shape)
  return imgs.astype(np.float32), labels


# ---------------------------------------------------------------------------
# Model and runs.


class MLP(nn.Module):
  hidden: int = 256

  @nn.compact
  def __call__(self, x):
    for i in range(3):
      x = nn.Dense(self.hidden, name=f"dense_{i}")(x)
      x = nn.LayerNorm(name=f"norm_{i}")(x)
      x = jnp.clip(x, -1.0, 1.0)  # hardtanh: a good fit for binary activations
    return nn.Dense(10, name="head")(x)


RUNS = {
    "float": [],
    "int8": [qtrain.QtRule(module_path=".*", weight_qtype="int8", act_qtype="int8",
                           bwd_qtype="int8", bwd_stochastic_rounding="uniform")],
    "binary": [
        qtrain.QtRule(module_path=r"dense_[12]", weight_qtype="binary", act_qtype="binary",
                      act_learnable_scale=True, act_scale_grad="bitorch",
                      act_estimator="clipped_ste", bwd_qtype="int8",
                      bwd_stochastic_rounding="uniform"),
        qtrain.QtRule(module_path=".*", weight_qtype="int8", act_qtype="int8",
                      bwd_qtype="int8", bwd_stochastic_rounding="uniform"),
    ],
}


def train(name: str, rules, data, *, steps: int, batch: int, lr: float, seed: int,
          eval_every: int):
  (xtr, ytr), (xte, yte) = data
  model = MLP()
  if rules:
    model = qtrain.quantize_model(model, qtrain.QtProvider(rules))
  variables = jax.jit(model.init)(jax.random.key(seed), xtr[:batch])  # one compile, not one per op
  state = train_state.TrainState.create(apply_fn=model.apply, params=variables["params"],
                                        tx=optax.adam(lr))
  qkey = jax.random.key(seed + 1)

  @jax.jit
  def step(state, x, y):
    k = jax.random.fold_in(qkey, state.step)  # a different rounding key every step

    def loss_fn(p):
      logits = state.apply_fn({"params": p}, x, rngs={"quant": k})
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    loss, g = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=g), loss

  @jax.jit
  def accuracy(params, x, y):
    return jnp.mean(jnp.argmax(model.apply({"params": params}, x), -1) == y)

  rng = np.random.default_rng(seed)
  losses, evals = [], []
  t_steps = 0.0
  bar = tqdm(range(steps), desc=f"{name:>6}", ncols=90, leave=True)
  for i in bar:
    idx = rng.integers(0, len(xtr), batch)
    t0 = time.perf_counter()
    state, loss = step(state, xtr[idx], ytr[idx])
    loss = float(loss)
    if i > 0:  # skip the compile
      t_steps += time.perf_counter() - t0
    losses.append(loss)
    if (i + 1) % eval_every == 0 or i + 1 == steps:
      evals.append((i + 1, float(accuracy(state.params, xte, yte))))
      bar.set_postfix(loss=f"{np.mean(losses[-20:]):.3f}", acc=f"{evals[-1][1]:.3f}")
  summary = None
  if rules:
    import warnings
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      summary = qtrain.summary(model)
  return dict(name=name, losses=losses, evals=evals,
              final_loss=float(np.mean(losses[-50:])), test_accuracy=evals[-1][1],
              step_ms=1e3 * t_steps / max(steps - 1, 1), summary=summary)


def make_parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  ap.add_argument("--steps", type=int, default=1000, help="training steps per run")
  ap.add_argument("--batch-size", type=int, default=128)
  ap.add_argument("--lr", type=float, default=3e-3)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--out-dir", default=os.path.join(tempfile.gettempdir(), "qtrain_quickstart"),
                  help="where results.json and loss.png go")
  ap.add_argument("--runs", default="float,int8,binary", help="comma list of: " + ", ".join(RUNS))
  return ap


def main(argv=None):
  ap = make_parser()
  args = ap.parse_args(argv)
  runs = [r.strip() for r in args.runs.split(",") if r.strip()]
  if not runs or any(r not in RUNS for r in runs):
    ap.error(f"--runs {args.runs!r}: a comma list of " + ", ".join(RUNS))
  if args.steps < 1:
    ap.error("--steps must be at least 1")
  os.makedirs(args.out_dir, exist_ok=True)
  data = (make_digits(50000, seed=args.seed), make_digits(2000, seed=args.seed + 1000))
  results = []
  t_all = time.perf_counter()
  for name in runs:
    results.append(train(name, RUNS[name], data, steps=args.steps, batch=args.batch_size,
                         lr=args.lr, seed=args.seed, eval_every=max(args.steps // 10, 1)))
  elapsed = time.perf_counter() - t_all

  head = f"{'run':<8}{'final loss':>12}{'test acc':>10}{'step (ms)':>11}"
  print("\n" + head + "\n" + "-" * len(head))
  for r in results:
    print(f"{r['name']:<8}{r['final_loss']:>12.4f}{r['test_accuracy']:>10.3f}{r['step_ms']:>11.2f}")
  print(f"\n{len(results)} runs x {args.steps} steps in {elapsed:.1f} s")
  for r in results:
    if r["summary"]:
      print(f"\n[{r['name']}] qtrain.summary:\n{r['summary']}")

  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
  for r in results:
    l = np.asarray(r["losses"])
    w = 20
    smooth = np.convolve(l, np.ones(w) / w, mode="valid") if len(l) >= w else l
    a1.plot(np.arange(len(smooth)) + (len(l) - len(smooth)), smooth, label=r["name"])
    a2.plot(*zip(*r["evals"]), marker="o", label=r["name"])
  a1.set(xlabel="step", ylabel="train loss (20-step mean)", yscale="log", title="training loss")
  a2.set(xlabel="step", ylabel="test accuracy", title="procedural digits, 10 classes")
  a1.legend(), a2.legend()
  fig.tight_layout()
  png = os.path.join(args.out_dir, "loss.png")
  fig.savefig(png, dpi=110)
  out = dict(args=vars(args), elapsed_s=elapsed, jax=jax.__version__,
             runs=[{k: v for k, v in r.items() if k != "summary"} for r in results])
  with open(os.path.join(args.out_dir, "results.json"), "w") as f:
    json.dump(out, f, indent=1)
  plt.close(fig)
  print(f"\nwrote {png} and {os.path.join(args.out_dir, 'results.json')}")
  return results


if __name__ == "__main__":
  main()
