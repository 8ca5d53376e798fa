r"""A character-level GPT trained on any text file: float vs int8 / fp8 / int4 / BitNet b1.58,
and a QLoRA fine-tune of the float model.

One decoder for every run: byte embeddings, ``--layers`` pre-norm blocks (RMSNorm ->
flax's causal ``MultiHeadDotProductAttention``, RMSNorm -> ``Dense(4 d) -> gelu -> Dense(d)``),
a final RMSNorm and a ``Dense`` head over the 256 byte values. What each run quantizes
(``--runs``; the embedding, the head and the attention's score / value products stay float in
all of them, as usual in quantized training):

  float    no quantization
  int8     w8a8 forward, int8 gradients with stochastic rounding (``low_bit_hash``)
  fp8      e4m3 forward, e5m2 gradients with stochastic rounding
  int4     int4 weights (one scale per output channel), int8 activations, int8 gradients
  bitnet   BitNet b1.58: ternary weights (one absmean scale per tensor), int8 activations (one
           absmax scale per token), straight-through gradients in float (the ``bitnet_b158``
           preset of :mod:`qtrain.binary`); the RMSNorm before every quantized projection is
           the paper's BitLinear input norm
  qlora    QLoRA: the float run's trained model (trained first if not asked for) frozen with
           int4 base weights (groups of 32, packed by ``qtrain.freeze``) and rank-8 adapters
           (alpha 16, dropout 0.05) on the same projections, then ``--steps`` more steps on
           the adapters alone (AdamW; only they have optimizer state). Its curve starts at the
           frozen int4 model's held-out loss (step 0) and is drawn after the float run's steps

Every run sees the same batches (random windows of ``--seq + 1`` bytes of the first 90% of the
text) and is scored on the same held-out windows of the last 10%. AdamW with a linear warmup
and a cosine decay; ``--lr`` for all runs.

Text (``--text``): a path, or by default ``shared/data/text/fortunes.txt`` next to the
repository, then ``$QTRAIN_TEXT``.

Outputs in ``--out-dir`` (default ``<system temp dir>/qtrain_train_lm``): ``summary.json``
(per run: the train loss every step, the held-out loss every ``--eval-every`` steps and at the
end, seconds per step after the first, parameter count; the arguments) and ``loss.png``.

Usage:
  python examples/train_lm.py                                   # every run, small model, CPU ok
  python examples/train_lm.py --runs float,bitnet --steps 2000 --d-model 256 --layers 4
  python examples/train_lm.py --text my.txt --runs int8 --out-dir /tmp/lm
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import _plot  # noqa: E402
import qtrain  # noqa: E402
from qtrain import binary, freeze, lora  # noqa: E402

RUNS = ("float", "int8", "fp8", "int4", "bitnet", "qlora")
VOCAB = 256  # bytes
ENV_VAR = "QTRAIN_TEXT"
SHARED_TEXT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))), "shared", "data", "text", "fortunes.txt")

# The decoder blocks' projections: attention q / k / v / out and both MLP layers.
_BLOCKS = dict(module_path=r"block_\d+/.*", op_names=("dot_general",))
_SR = "low_bit_hash"


def rules(run: str) -> list[qtrain.QtRule] | None:
  """The rules of a run (None for float)."""
  if run == "float":
    return None
  if run == "int8":
    return [qtrain.QtRule(**_BLOCKS, weight_qtype="int8", act_qtype="int8", bwd_qtype="int8",
                          bwd_stochastic_rounding=_SR)]
  if run == "fp8":
    return [qtrain.QtRule(**_BLOCKS, weight_qtype="float8_e4m3fn", act_qtype="float8_e4m3fn",
                          bwd_qtype="float8_e5m2", bwd_stochastic_rounding=_SR)]
  if run == "int4":
    return [qtrain.QtRule(**_BLOCKS, weight_qtype="int4", act_qtype="int8", bwd_qtype="int8",
                          bwd_stochastic_rounding=_SR)]
  if run == "bitnet":
    return [dataclasses.replace(r, **_BLOCKS) for r in binary.bitnet_b158().to_rules()]
  if run == "qlora":
    return [qtrain.QtRule(**_BLOCKS, weight_qtype="int4", tile_size=32, lora_rank=8,
                          lora_alpha=16.0, lora_dropout=0.05)]
  raise ValueError(f"unknown run {run!r}; valid: {list(RUNS)}")


class Block(nn.Module):
  d_model: int
  heads: int

  @nn.compact
  def __call__(self, x):
    h = nn.RMSNorm(name="norm_attn")(x)
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
    x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads, name="attn")(h, h, mask=mask)
    h = nn.Dense(4 * self.d_model, name="mlp_up")(nn.RMSNorm(name="norm_mlp")(x))
    # BitLinear normalises every quantized projection's input: the down projection too.
    h = nn.RMSNorm(name="norm_down")(nn.gelu(h))
    return x + nn.Dense(self.d_model, name="mlp_down")(h)


class GPT(nn.Module):
  d_model: int
  layers: int
  heads: int

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(VOCAB, self.d_model, name="embed")(tokens)
    for i in range(self.layers):
      x = Block(self.d_model, self.heads, name=f"block_{i}")(x)
    return nn.Dense(VOCAB, name="head")(nn.RMSNorm(name="norm_out")(x))


def resolve_text(path: str | None) -> str:
  """``--text``, else the shared corpus next to the repository, else ``$QTRAIN_TEXT``."""
  candidates = [path] if path else [SHARED_TEXT, os.environ.get(ENV_VAR)]
  for p in candidates:
    if p and os.path.isfile(p):
      return p
  if path:
    raise SystemExit(f"--text {path}: no such file")
  raise SystemExit(f"no text found (looked for {SHARED_TEXT} and ${ENV_VAR}); pass --text PATH "
                   "with any UTF-8 or byte text of a few hundred kB or more")


def load_bytes(path: str, seq: int) -> tuple[np.ndarray, np.ndarray]:
  """(train, held-out) byte arrays: the first 90% of the file and the last 10%."""
  with open(path, "rb") as f:
    data = np.frombuffer(f.read(), np.uint8)
  split = int(len(data) * 0.9)
  if split < seq + 2 or len(data) - split < seq + 2:
    raise SystemExit(f"--text {path}: {len(data)} bytes; its 90% / 10% splits need at least "
                     f"{seq + 2} bytes each for --seq {seq}")
  return data[:split], data[split:]


def windows(data: np.ndarray, rng: np.random.Generator, batch: int, seq: int) -> np.ndarray:
  starts = rng.integers(0, len(data) - seq - 1, batch)
  return np.stack([data[s:s + seq + 1] for s in starts]).astype(np.int32)


def make_optimizer(lr: float, steps: int) -> optax.GradientTransformation:
  warmup = max(1, min(100, steps // 10))
  schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), lr * 0.1)
  return optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1))


@dataclasses.dataclass(frozen=True)
class Setup:
  """What one run trains: ``apply(p, tokens, rngs)`` and the initial trainable params."""
  apply: Callable
  params: Any
  extra: dict


def setup(run: str, args, example, base_params=None) -> Setup:
  model = GPT(args.d_model, args.layers, args.heads)
  if run != "qlora":
    r = rules(run)
    if r is not None:
      model = qtrain.quantize_model(model, qtrain.QtProvider(r))
    params = jax.jit(model.init)(jax.random.key(args.seed), example)["params"]
    return Setup(lambda p, t, rngs: model.apply({"params": p}, t, rngs=rngs), params, {})
  # QLoRA: fresh adapters beside the float run's weights, then the blocks' weights frozen as
  # packed int4; only the adapters are trained (and have optimizer state).
  provider = qtrain.QtProvider(rules(run))
  qmodel = qtrain.quantize_model(model, provider)
  fresh, _ = lora.split(jax.jit(qmodel.init)(jax.random.key(args.seed + 7), example)["params"])
  frozen = freeze.freeze({"params": lora.combine(fresh, base_params)}, provider)
  adapters, rest = lora.split(frozen["variables"]["params"])

  def apply(ad, tokens, rngs):
    v = {"params": lora.combine(ad, rest)}
    return freeze.apply_frozen(model, {"layers": frozen["layers"], "variables": v}, tokens,
                               rngs=rngs)
  sizes = freeze.layer_sizes(frozen).values()
  return Setup(apply, adapters, dict(
      frozen_layers=len(frozen["layers"]),
      frozen_bytes=int(sum(v["frozen_bytes"] for v in sizes)),
      float32_bytes=int(sum(v["float32_bytes"] for v in sizes))))


def train_one(run: str, args, train: np.ndarray, held: np.ndarray, base_params=None):
  """Trains one run; returns (its summary, its final params)."""
  from tqdm import tqdm

  # The fine-tune sees other windows than the float run it starts from.
  data_rng = np.random.default_rng(args.seed + (1 if run == "qlora" else 0))
  example = jnp.asarray(windows(train, data_rng, args.batch, args.seq)[:, :-1])
  st = setup(run, args, example, base_params)
  params = st.params
  tx = make_optimizer(args.lr, args.steps)
  opt_state = tx.init(params)

  def loss_fn(p, batch, key):
    k_sr, k_drop = jax.random.split(key)
    logits = st.apply(p, batch[:, :-1], {qtrain.RNG_STREAM: k_sr, "dropout": k_drop})
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

  @jax.jit
  def step(p, s, batch, key):
    loss, grads = jax.value_and_grad(loss_fn)(p, batch, key)
    updates, s = tx.update(grads, s, p)
    return optax.apply_updates(p, updates), s, loss

  @jax.jit
  def eval_loss(p, batch):
    logits = st.apply(p, batch[:, :-1], {qtrain.RNG_STREAM: jax.random.key(0)})
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

  eval_rng = np.random.default_rng(12345)  # the same held-out windows for every run
  eval_batches = [windows(held, eval_rng, args.batch, args.seq) for _ in range(args.eval_batches)]

  def held_out(p) -> float:
    return float(np.mean([float(eval_loss(p, jnp.asarray(b))) for b in eval_batches]))

  base_key = jax.random.key(args.seed + 1)
  losses, evals, times = [], [], []
  if run == "qlora":  # the frozen int4 model before any fine-tuning
    evals.append((0, held_out(params)))
  bar = tqdm(range(args.steps), desc=run, mininterval=2.0, disable=args.no_tqdm)
  for i in bar:
    batch = jnp.asarray(windows(train, data_rng, args.batch, args.seq))
    t0 = time.perf_counter()
    params, opt_state, loss = step(params, opt_state, batch, jax.random.fold_in(base_key, i))
    loss = float(loss)  # waits for the step
    times.append(time.perf_counter() - t0)
    if not math.isfinite(loss):
      raise SystemExit(f"run {run}: loss {loss} at step {i}")
    losses.append(loss)
    if (i + 1) % args.eval_every == 0 or i + 1 == args.steps:
      evals.append((i + 1, held_out(params)))
      bar.set_postfix(loss=f"{loss:.3f}", held_out=f"{evals[-1][1]:.3f}")
  n_params = int(sum(np.prod(v.shape) for v in jax.tree.leaves(params)))
  return dict(run=run, train_loss=losses, held_out=evals, final_held_out=evals[-1][1],
              s_per_step=float(np.median(times[1:])) if len(times) > 1 else times[0],
              params=n_params, trained_params=n_params, **st.extra), params


def plot(results: dict, path: str, offset: int = 0) -> None:
  curves = {f"{name} ({r['final_held_out']:.3f})":
            tuple(zip(*[(s + (offset if name == "qlora" else 0), v) for s, v in r["held_out"]]))
            for name, r in results.items()}
  _plot.save_curves(curves, path, xlabel="step", ylabel="held-out loss (nats per byte)",
                    title="character-level GPT: held-out loss")


def make_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated of {list(RUNS)}")
  p.add_argument("--text", default=None, help="a text file (default: the shared corpus)")
  p.add_argument("--steps", type=int, default=300)
  p.add_argument("--d-model", type=int, default=128)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--seq", type=int, default=128, help="bytes per training window")
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--lr", type=float, default=2e-3, help="AdamW's peak learning rate")
  p.add_argument("--eval-every", type=int, default=50)
  p.add_argument("--eval-batches", type=int, default=4)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out-dir", default=os.path.join(tempfile.gettempdir(), "qtrain_train_lm"))
  p.add_argument("--no-tqdm", action="store_true")
  return p


def main(argv=None) -> dict:
  args = make_parser().parse_args(argv)
  runs = [r for r in args.runs.split(",") if r]
  bad = [r for r in runs if r not in RUNS]
  if bad or not runs:
    raise SystemExit(f"--runs {args.runs!r}: unknown {bad}; valid: {', '.join(RUNS)}")
  for name in ("steps", "d_model", "layers", "heads", "seq", "batch", "eval_every", "eval_batches"):
    if getattr(args, name) <= 0:
      raise SystemExit(f"--{name.replace('_', '-')} {getattr(args, name)} must be positive")
  if args.d_model % args.heads:
    raise SystemExit(f"--d-model {args.d_model} must be a multiple of --heads {args.heads}")
  text = resolve_text(args.text)
  train, held = load_bytes(text, args.seq)
  os.makedirs(args.out_dir, exist_ok=True)
  print(f"text {text}: {len(train):,} train / {len(held):,} held-out bytes; "
        f"d_model {args.d_model}, {args.layers} layers, {args.steps} steps", flush=True)
  if "qlora" in runs:  # it fine-tunes the float run's model: float trains first
    if "float" not in runs:
      print("qlora fine-tunes the float model: training the float run first", flush=True)
    runs = ["float"] + [r for r in runs if r != "float"]
  results, float_params = {}, None
  for run in runs:
    results[run], params = train_one(run, args, train, held, float_params)
    if run == "float":
      float_params = params
    r = results[run]
    print(f"{run:7s} held-out loss {r['final_held_out']:.4f}  {1e3 * r['s_per_step']:.1f} ms/step",
          flush=True)
  summary = {"args": {**vars(args), "text": text}, "runs": results}
  with open(os.path.join(args.out_dir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
  plot(results, os.path.join(args.out_dir, "loss.png"), offset=args.steps)
  base = results.get("float")
  print("\n| run | held-out loss | vs float | ms/step |\n|---|---|---|---|")
  for run, r in results.items():
    gap = "" if base is None else f"{100 * (r['final_held_out'] / base['final_held_out'] - 1):+.1f}%"
    print(f"| {run} | {r['final_held_out']:.4f} | {gap} | {1e3 * r['s_per_step']:.1f} |")
  print(f"\nwrote {args.out_dir}/summary.json and loss.png")
  return summary


if __name__ == "__main__":
  main()
