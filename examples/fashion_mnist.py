r"""Fashion-MNIST: float vs binary (weights + activations) vs 4-bit and 2-bit weights.

One CNN for every run; only the middle layers are quantized (first and last
layer in float, batch norm after every quantized layer - the larq / bitorch
recipe):

  conv1 3x3xW (float) -> BN -> act -> maxpool
  conv2 3x3x2W (Q)    -> maxpool -> BN -> act
  conv3 3x3x2W (Q)    -> maxpool -> BN -> act
  dense1 256 (Q)      -> BN -> act
  dense2 10 (float)

Runs (``--runs``): ``float``; ``binary`` (bitorch-engine binary weights and
activations: learned input scale and shift, clipped STE, per-channel weight
scale; act = identity since the next layer binarizes); ``larq`` (larq
``ste_sign``, no scales); ``w4`` / ``w2`` (4-/2-bit weights, asymmetric
group-wise scales (64 / 32 input features per group in dense layers,
per-channel in convs), float activations). Adam with a cosine learning-rate
decay; binary latent weights clipped to [-1, 1] (:func:`qtrain.optim.clip_latent_weights`);
the learned input scales ``scale_a`` at 0.01x the learning rate (``--act-scale-lr-mult``;
at 1x they collapse to 0 under batch norm, see :func:`qtrain.binary.bitorch`).

``--api qlayers`` (default) builds the quantized layers from
:mod:`qtrain.qlayers`; ``--api rules`` builds the same CNN from plain
``nn.Conv`` / ``nn.Dense`` and quantizes it with ``qtrain.quantize_model`` and
the equivalent :class:`qtrain.QtRule` s (:func:`qtrain.binary.rules`); both
give the same numbers.

After each run the model is frozen (:func:`qtrain.freeze.freeze`: packed
weights + scales), the frozen model is evaluated through the packed-matmul
inference path, and the sizes are reported.

Outputs in ``--out-dir`` (default ``<system temp dir>/qtrain_fashion_mnist``, e.g.
``/tmp/qtrain_fashion_mnist``): ``summary.json`` (per run: test accuracy, train loss and train
accuracy per epoch - the latter two the means over all the epoch's steps - seconds per epoch,
model sizes, frozen-model accuracy; runs already in it from earlier calls are kept),
``accuracy.png``, and ``<run>_params.msgpack`` (trained variables).

Data: the four Fashion-MNIST IDX files (``train-images-idx3-ubyte.gz`` ...), looked for in
``--data-dir``, then ``$QTRAIN_DATA_DIR``, then ``shared/data/fashion-mnist`` next to the
repository, then Debian's ``/usr/share/datasets/fashion-mnist`` (package
dataset-fashion-mnist); download them from
https://github.com/zalandoresearch/fashion-mnist/tree/master/data/fashion.

Usage:
  python examples/fashion_mnist.py --epochs 15 --runs float,binary,w4,w2 --out-dir /tmp/fmnist
  python examples/fashion_mnist.py --epochs 1 --limit-train 5000 --runs binary   # a quick look
  # GPU, time per epoch (median of epochs 2..N excludes compilation), kernels for frozen inference:
  python examples/fashion_mnist.py --epochs 3 --runs float,binary,w4,w2 --out-dir $OUT/fmnist \
      --freeze-implementation triton --no-tqdm
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import serialization  # noqa: E402

import _data  # noqa: E402
import _plot  # noqa: E402
from qtrain import binary  # noqa: E402
from qtrain import optim  # noqa: E402
from qtrain.qlayers import QConv, QDense  # noqa: E402

QUANT_LAYERS = ("conv2", "conv3", "dense1")
RUN_NAMES = ("float", "binary", "larq", "xnor", "binary_w", "w8", "w4", "w2")


def run_preset(run: str) -> tuple[binary.LayerQuant | None, binary.LayerQuant | None]:
  """(conv quant, dense quant) of a run name."""
  if run == "float":
    return None, None
  if run == "binary":
    return binary.bitorch(), binary.bitorch()
  if run == "larq":
    return binary.larq(), binary.larq()
  if run == "xnor":
    return binary.xnor(), binary.xnor()
  if run == "binary_w":
    return binary.bitorch(binary_act=False), binary.bitorch(binary_act=False)
  if run == "w8":
    return binary.mpq(bits=8, group_size=None), binary.mpq(bits=8, group_size=64)
  if run == "w4":
    return binary.mpq(bits=4, group_size=None), binary.mpq(bits=4, group_size=64)
  if run == "w2":
    return binary.mpq(bits=2, group_size=None), binary.mpq(bits=2, group_size=32)
  raise ValueError(f"unknown run {run!r}")


def is_binary_act(run: str) -> bool:
  return run in ("binary", "larq", "xnor")


def max_pool2(v):
  """2x2 max pooling, stride 2, VALID (a reshape + max: on XLA CPU its gradient is ~10x
  faster than ``nn.max_pool``'s select-and-scatter)."""
  b, h, w, c = v.shape
  v = v[:, :h // 2 * 2, :w // 2 * 2]
  return v.reshape(b, h // 2, 2, w // 2, 2, c).max(axis=(2, 4))


class CNN(nn.Module):
  """The CNN; ``plain=True`` builds it from nn.Conv / nn.Dense (for ``quantize_model``)."""
  conv_quant: binary.LayerQuant | None = None
  dense_quant: binary.LayerQuant | None = None
  width: int = 32
  binary_act: bool = False
  plain: bool = False

  @nn.compact
  def __call__(self, x, train: bool = False):
    bn = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9)
    act = (lambda v: v) if self.binary_act else nn.relu
    pool = max_pool2
    if self.plain:
      conv = lambda f, quant, name: nn.Conv(f, (3, 3), name=name)
      dense = lambda f, quant, name: nn.Dense(f, name=name)
    else:
      conv = lambda f, quant, name: QConv(f, (3, 3), quant=quant, name=name)
      dense = lambda f, quant, name: QDense(f, quant=quant, name=name)
    x = conv(self.width, None, "conv1")(x)
    x = pool(act(bn(name="bn1")(x)))
    x = conv(2 * self.width, self.conv_quant, "conv2")(x)
    x = act(bn(name="bn2")(pool(x)))
    x = conv(2 * self.width, self.conv_quant, "conv3")(x)
    x = act(bn(name="bn3")(pool(x)))
    x = x.reshape(x.shape[0], -1)
    x = dense(256, self.dense_quant, "dense1")(x)
    x = act(bn(name="bn4")(x))
    return dense(10, None, "dense2")(x)

  def layer_quants(self) -> dict:
    """``{layer name: LayerQuant}`` of the quantized layers (for freeze)."""
    if self.conv_quant is None and self.dense_quant is None:
      return {}
    return {"conv2": self.conv_quant, "conv3": self.conv_quant, "dense1": self.dense_quant}

  def rules(self) -> list:
    """The same quantization as :class:`qtrain.QtRule` s (first and last layer float)."""
    return binary.rules({"conv1|dense2": None, "conv2|conv3": self.conv_quant,
                         "dense1": self.dense_quant})


def make_model(run: str, width: int, api: str = "qlayers"):
  """(model to train, model to run frozen, what freeze takes)."""
  cq, dq = run_preset(run)
  if api == "qlayers":
    m = CNN(conv_quant=cq, dense_quant=dq, width=width, binary_act=is_binary_act(run))
    return m, m, m.layer_quants()
  if api != "rules":
    raise ValueError(f"--api {api!r}: qlayers or rules")
  import qtrain
  plain = CNN(conv_quant=cq, dense_quant=dq, width=width, binary_act=is_binary_act(run), plain=True)
  if cq is None and dq is None:
    return plain, plain, {}
  rules = plain.rules()
  return qtrain.quantize_model(plain, qtrain.QtProvider(rules)), plain, rules


def preprocess(x: np.ndarray) -> np.ndarray:
  return ((x.astype(np.float32) / 255.0 - 0.2860) / 0.3530)[..., None]


def make_optimizer(run: str, lr: float, total_steps: int, act_scale_lr_mult: float = 0.01):
  """Adam + cosine decay; binary runs: latent weights clipped to [-1, 1].

  The learned input scales ``scale_a`` of bitorch layers get ``act_scale_lr_mult`` times
  the learning rate: with batch norm after the layer the loss does not depend on the
  output scale, and bitorch's scale gradient (sum(g_x_clipped * sign(x)) / sqrt(n)) then
  pushes ``scale_a`` steadily down under Adam's normalised steps; at the full rate it
  reached 0 within ~3 epochs (every input clipped, no gradient through the layer, and the
  network collapsed to 10% test accuracy). At 0.01x it stays near its init.
  """
  sched = optax.cosine_decay_schedule(lr, max(total_steps, 1), alpha=0.01)
  scale_sched = lambda step: act_scale_lr_mult * sched(step)

  def labels(params):
    return jax.tree.map(lambda m: "act_scale" if m else "main",
                        optim.path_mask(r"(.*/)?(scale_a|.*_act_scale)")(params))

  parts = [optax.multi_transform({"main": optax.adam(sched), "act_scale": optax.adam(scale_sched)},
                                 labels)]
  if run in ("binary", "larq", "xnor", "binary_w"):
    parts.append(optim.clip_latent_weights(1.0, mask=optim.path_mask(
        r"(%s)/kernel" % "|".join(QUANT_LAYERS))))
  return optax.chain(*parts)


def train_one(run: str, args, data, out_dir: str) -> dict:
  x_tr, y_tr, x_te, y_te = data
  model, float_model, fz_rules = make_model(run, args.width, args.api)
  rng = jax.random.key(args.seed)
  n = x_tr.shape[0]
  steps_per_epoch = n // args.batch_size
  # Init in train mode: batch norm normalises the init batch, so each layer's scale_a starts
  # at 2 * mean|x| of the activations it will see.
  # (Jitted: one compile instead of one per initializer op.)
  variables = jax.jit(functools.partial(model.init, train=True))(
      rng, jnp.asarray(x_tr[:args.batch_size]))
  params, batch_stats = variables["params"], variables["batch_stats"]
  tx = make_optimizer(run, args.lr, steps_per_epoch * args.epochs, args.act_scale_lr_mult)
  opt_state = tx.init(params)

  def loss_fn(params, batch_stats, x, y):
    logits, upd = model.apply({"params": params, "batch_stats": batch_stats}, x, train=True,
                              mutable=["batch_stats"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, (upd["batch_stats"], logits)

  @jax.jit
  def train_step(params, batch_stats, opt_state, sums, x, y):
    """One step; ``sums`` = (loss sum, accuracy sum) of the epoch so far, kept on device."""
    (loss, (bs, logits)), g = jax.value_and_grad(loss_fn, has_aux=True)(params, batch_stats, x, y)
    updates, opt_state = tx.update(g, opt_state, params)
    params = optax.apply_updates(params, updates)
    acc = jnp.mean(jnp.argmax(logits, -1) == y)
    return params, bs, opt_state, (sums[0] + loss, sums[1] + acc)

  @jax.jit
  def eval_logits(params, batch_stats, x):
    return model.apply({"params": params, "batch_stats": batch_stats}, x, train=False)

  def evaluate(params, batch_stats):
    correct = 0
    for i in range(0, x_te.shape[0], 1000):
      logits = eval_logits(params, batch_stats, jnp.asarray(x_te[i:i + 1000]))
      correct += int(jnp.sum(jnp.argmax(logits, -1) == jnp.asarray(y_te[i:i + 1000])))
    return correct / x_te.shape[0]

  from tqdm import tqdm
  np_rng = np.random.default_rng(args.seed)
  hist = {"test_acc": [], "train_loss": [], "train_acc": [], "epoch_seconds": []}
  for epoch in range(args.epochs):
    perm = np_rng.permutation(n)
    t0 = time.perf_counter()
    # Train loss / accuracy of the epoch: the mean over all its steps, summed on device
    # (read back once per epoch; every 50 steps for the progress bar when it is shown).
    sums = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
    bar = tqdm(range(steps_per_epoch), desc=f"{run} epoch {epoch + 1}/{args.epochs}",
               leave=False, mininterval=2.0, disable=args.no_tqdm)
    for s in bar:
      idx = perm[s * args.batch_size:(s + 1) * args.batch_size]
      params, batch_stats, opt_state, sums = train_step(
          params, batch_stats, opt_state, sums, jnp.asarray(x_tr[idx]), jnp.asarray(y_tr[idx]))
      if not args.no_tqdm and (s + 1) % 50 == 0:
        bar.set_postfix(loss=f"{float(sums[0]) / (s + 1):.3f}",
                        acc=f"{float(sums[1]) / (s + 1):.3f}")
    jax.block_until_ready(params)
    dt = time.perf_counter() - t0
    test_acc = evaluate(params, batch_stats)
    hist["test_acc"].append(test_acc)
    hist["train_loss"].append(float(sums[0]) / steps_per_epoch)
    hist["train_acc"].append(float(sums[1]) / steps_per_epoch)
    hist["epoch_seconds"].append(dt)
    print(f"[{run}] epoch {epoch + 1}: test acc {test_acc:.4f}  train loss "
          f"{hist['train_loss'][-1]:.4f} (epoch mean)  {dt:.1f}s", flush=True)
  variables = {"params": params, "batch_stats": batch_stats}
  with open(os.path.join(out_dir, f"{run}_params.msgpack"), "wb") as f:
    f.write(serialization.to_bytes(variables))
  res = {"run": run, "api": args.api, "epochs": args.epochs, "batch_size": args.batch_size, "width": args.width,
         "train_examples": int(n), **hist,
         "final_test_acc": hist["test_acc"][-1], "best_test_acc": max(hist["test_acc"]),
         "seconds_per_epoch_median": float(np.median(hist["epoch_seconds"][1:]
                                                     or hist["epoch_seconds"])),
         "first_epoch_seconds_incl_compile": hist["epoch_seconds"][0],
         "backend": jax.default_backend(), "device": str(jax.devices()[0])}
  res.update(safe_freeze_report(float_model, fz_rules, variables, x_te, y_te, eval_logits, args))
  return res


def safe_freeze_report(model, fz_rules, variables, x_te, y_te, eval_logits, args) -> dict:
  try:
    return freeze_report(model, fz_rules, variables, x_te, y_te, eval_logits, args)
  except Exception as e:  # keep the training results even if the export fails
    import traceback
    traceback.print_exc()
    return {"freeze_error": repr(e)}


def report_only(run: str, args, data, out_dir: str, old: dict) -> dict:
  """Recomputes the freeze report of a finished run from its saved variables."""
  _, _, x_te, y_te = data
  model, float_model, fz_rules = make_model(run, args.width, args.api)
  template = model.init(jax.random.key(0), jnp.asarray(x_te[:2]), train=False)
  with open(os.path.join(out_dir, f"{run}_params.msgpack"), "rb") as f:
    variables = serialization.from_bytes(
        {"params": template["params"], "batch_stats": template["batch_stats"]}, f.read())
  eval_logits = jax.jit(lambda p, b, x: model.apply({"params": p, "batch_stats": b}, x,
                                                    train=False))
  res = {k: v for k, v in old.items() if k not in ("freeze_error",)}
  res.update(safe_freeze_report(float_model, fz_rules, variables, x_te, y_te, eval_logits, args))
  return res


def freeze_report(model: CNN, fz_rules, variables, x_te, y_te, eval_logits, args) -> dict:
  """Freezes the model, checks the packed inference path and reports sizes."""
  from qtrain import freeze as fz
  frozen = fz.freeze(variables, fz_rules)
  sizes = fz.layer_sizes(frozen, variables)
  x = jnp.asarray(x_te[:1000])
  ref = eval_logits(variables["params"], variables["batch_stats"], x)
  out = fz.apply_frozen(model, frozen, x, implementation=args.freeze_implementation,
                        train=False)
  agree = float(jnp.mean(jnp.argmax(out, -1) == jnp.argmax(ref, -1)))
  correct = 0
  for i in range(0, x_te.shape[0], 1000):
    lo = fz.apply_frozen(model, frozen, jnp.asarray(x_te[i:i + 1000]),
                         implementation=args.freeze_implementation, train=False)
    correct += int(jnp.sum(jnp.argmax(lo, -1) == jnp.asarray(y_te[i:i + 1000])))
  return {"model_sizes": sizes, "frozen_test_acc": correct / x_te.shape[0],
          "frozen_vs_trained_argmax_agreement_1k": agree,
          "frozen_vs_trained_max_abs_logit_diff_1k": float(jnp.max(jnp.abs(out - ref)))}


def plot(results: dict, path: str):
  curves = {f"{run} ({100 * r['final_test_acc']:.2f}%)":
            (np.arange(1, len(r["test_acc"]) + 1), 100 * np.asarray(r["test_acc"]))
            for run, r in results.items()}
  _plot.save_curves(curves, path, xlabel="epoch", ylabel="test accuracy (%)",
                    title="Fashion-MNIST: float vs binary vs low-bit weights")


def make_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--data-dir", default=None,
                 help="folder of the Fashion-MNIST IDX files; if unset or without them: "
                      f"${_data.ENV_VAR}, then {_data.SHARED_DIR}, then {_data.DEBIAN_DIR}")
  p.add_argument("--epochs", type=int, default=15)
  p.add_argument("--runs", default="float,binary,w4,w2",
                 help="comma list of: " + ", ".join(RUN_NAMES))
  p.add_argument("--out-dir", default=os.path.join(tempfile.gettempdir(), "qtrain_fashion_mnist"),
                 help="where summary.json, accuracy.png and <run>_params.msgpack go "
                      "(default: %(default)s)")
  p.add_argument("--batch-size", type=int, default=128)
  p.add_argument("--lr", type=float, default=2e-3)
  p.add_argument("--width", type=int, default=32)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--act-scale-lr-mult", type=float, default=0.01,
                 help="learning-rate multiplier of the learned input scales (scale_a)")
  p.add_argument("--limit-train", type=int, default=0, help="use only the first N training images")
  p.add_argument("--freeze-implementation", default="xla",
                 choices=("auto", "xla", "triton", "mosaic", "interpret"),
                 help="where the frozen model's products run (qtrain.freeze)")
  p.add_argument("--api", default="qlayers", choices=("qlayers", "rules"),
                 help="qlayers: qtrain.qlayers.QConv/QDense; rules: nn.Conv/nn.Dense + "
                      "qtrain.quantize_model with the same quantization as QtRules")
  p.add_argument("--no-tqdm", action="store_true")
  p.add_argument("--report-only", action="store_true",
                 help="skip training: redo the freeze report of runs saved in --out-dir")
  return p


def main(argv=None):
  p = make_parser()
  args = p.parse_args(argv)
  if args.epochs < 1:
    p.error("--epochs must be at least 1")
  runs = [r.strip() for r in args.runs.split(",") if r.strip()]
  if not runs or any(r not in RUN_NAMES for r in runs):
    p.error(f"--runs {args.runs!r}: a comma list of " + ", ".join(RUN_NAMES))
  try:
    data_dir = _data.resolve_data_dir(args.data_dir)
  except _data.DataNotFoundError as e:
    sys.exit(f"{p.prog}: {e}")
  print(f"Fashion-MNIST from {data_dir}", flush=True)
  os.makedirs(args.out_dir, exist_ok=True)
  x_tr, y_tr, x_te, y_te = _data.load_mnist_like(data_dir)
  if args.limit_train:
    x_tr, y_tr = x_tr[:args.limit_train], y_tr[:args.limit_train]
  if x_tr.shape[0] < args.batch_size:
    p.error(f"{x_tr.shape[0]} training images, fewer than --batch-size {args.batch_size}")
  data = (preprocess(x_tr), y_tr.astype(np.int32), preprocess(x_te), y_te.astype(np.int32))
  summary_path = os.path.join(args.out_dir, "summary.json")
  results = {}
  if os.path.exists(summary_path):
    with open(summary_path) as f:
      results = json.load(f).get("runs", {})
  for run in runs:
    if args.report_only:
      results[run] = report_only(run, args, data, args.out_dir, results.get(run, {}))
    else:
      results[run] = train_one(run, args, data, args.out_dir)
    with open(summary_path, "w") as f:
      json.dump({"args": vars(args), "runs": results}, f, indent=1)
    plot(results, os.path.join(args.out_dir, "accuracy.png"))
  print(json.dumps({k: {kk: v[kk] for kk in ("final_test_acc", "best_test_acc",
                                             "seconds_per_epoch_median") if kk in v}
                    for k, v in results.items()}, indent=1))
  print(f"wrote {summary_path} and {os.path.join(args.out_dir, 'accuracy.png')}")
  return results


if __name__ == "__main__":
  main()
