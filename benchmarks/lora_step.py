"""LoRA / QLoRA fine-tuning benchmark: memory and speed of adapter training on a frozen base.

The model is lm_step.py's GPT-style byte-level decoder (flax's own layers, bf16 activations
and parameters). Adapters of rank ``--rank`` (alpha = 2 x rank) go on every ``dot_general``
of the decoder blocks (the attention's query / key / value / out projections and both MLP
layers); embeddings, LayerNorms and the head stay as they are and are not trained. AdamW as
in lm_step.py, on the adapters alone. The configs (``CONFIGS``):

  full_bf16     full fine-tune in bf16, every parameter trained (lm_step.py's bf16): the
                memory every LoRA config saves against
  lora_bf16     LoRA: the bf16 base is an argument of the step, not differentiated, with no
                optimizer state; adapters in float32
  qlora_int8    QLoRA: the base weights of the blocks frozen as packed int8 codes (one scale
                per output channel, qtrain.freeze), bf16 activations, the frozen products run
                by ``implementation="auto"`` (at training sizes: XLA on the weight dequantized
                to bf16, one layer at a time); gradients reach the adapters through the
                dequantized weights
  qlora_int4    as qlora_int8 with int4 codes in groups of 64 along K
  qlora_nf4     as qlora_int4 with NF4 codes (QLoRA's 4-bit normal-float value set, groups of
                64 along K: the QLoRA paper's storage format, without its double quantization)
  qlora_int4_triton  qlora_int4 with every frozen forward product forced onto the packed
                W4A16 Triton kernel (what "auto" picks only for M <= 16 rows)

Per config: ms/step (``--steps`` steps in one jit, median of ``--repeats``), tokens/s, peak
device memory of the compiled loop (arguments + outputs - donated + temporaries, as in
lm_step.py), the bytes of the base weights and of the trainable state (adapters + AdamW
moments), compile seconds, and the training loss after the timed steps. Every config starts
from the same float init (float32, cast to bf16) and the same adapters.

On the GPU machine:

  python3 benchmarks/lora_step.py --widths 2048 --out-dir $OUT

On a CPU (tiny sizes; never into RESULTS.md):

  python3 benchmarks/lora_step.py --widths 64 --layers 1 --seq 64 --batch 2 --steps 2 \\
      --repeats 1 --configs lora_bf16,qlora_int8,qlora_int4,qlora_nf4,full_bf16   # the Triton one needs a GPU
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import qtrain  # noqa: E402
from benchmarks import _record  # noqa: E402
from benchmarks import lm_step  # noqa: E402
from qtrain import freeze, lora  # noqa: E402

CONFIGS = {
    "full_bf16": "full fine-tune, bf16, every parameter trained",
    "lora_bf16": "LoRA on a bf16 base (not differentiated, no optimizer state)",
    "qlora_int8": "QLoRA: frozen packed int8 base (per channel), bf16 activations",
    "qlora_int4": "QLoRA: frozen packed int4 base (groups of 64), bf16 activations",
    "qlora_nf4": "QLoRA: frozen packed NF4 base (groups of 64), bf16 activations",
    "qlora_int4_triton": "qlora_int4 with the frozen forward products on the packed Triton kernel",
}
BASELINE = "lora_bf16"


def rules(name: str, rank: int) -> list[qtrain.QtRule]:
  ad = dict(module_path=r"block_\d+/.*", op_names=("dot_general",), lora_rank=rank,
            lora_alpha=2.0 * rank)
  if name == "lora_bf16":
    return [qtrain.QtRule(**ad)]
  if name == "qlora_int8":
    return [qtrain.QtRule(**ad, weight_qtype="int8")]
  if name == "qlora_nf4":
    return [qtrain.QtRule(**ad, weight_qtype="nf4", tile_size=64)]
  return [qtrain.QtRule(**ad, weight_qtype="int4", tile_size=64)]


def _nbytes(tree) -> int:
  return int(sum(np.prod(np.shape(x)) * jnp.dtype(x.dtype).itemsize
                 for x in jax.tree.leaves(tree)))


def setup(name: str, shape: lm_step.Shape, rank: int, base_params):
  """(loss_fn(trainable, fixed, tokens), trainable, fixed, base bytes)."""
  model = shape.decoder()
  if name == "full_bf16":
    def loss_full(p, fixed, tokens):
      logits = model.apply({"params": p}, tokens[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(
          logits.astype(jnp.float32), tokens[:, 1:]).mean()
    return loss_full, base_params, {}, _nbytes(base_params)
  prov = qtrain.QtProvider(rules(name, rank))
  qm = qtrain.quantize_model(model, prov)
  tokens = jnp.zeros((1, shape.seq), jnp.int32)
  v = jax.jit(qm.init)(jax.random.key(7), tokens)
  adapters, _ = lora.split(v["params"])
  params = lora.combine(adapters, base_params)

  def xent(logits, tokens):
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), tokens[:, 1:]).mean()

  if name == "lora_bf16":
    _, rest = lora.split(params)

    def loss_lora(ad, fixed, tokens):
      return xent(qm.apply({"params": lora.combine(ad, fixed)}, tokens[:, :-1]), tokens)
    blocks = {k: v for k, v in rest.items() if k.startswith("block_")}
    return loss_lora, adapters, rest, _nbytes(blocks)
  frozen = freeze.freeze({"params": params}, prov)
  ad, rest = lora.split(frozen["variables"]["params"])
  impl = "triton" if name.endswith("_triton") else "auto"

  def loss_qlora(ad, fixed, tokens):
    fv = {"params": lora.combine(ad, fixed["rest"])}
    logits = freeze.apply_frozen(model, {"layers": fixed["layers"], "variables": fv},
                                 tokens[:, :-1], implementation=impl)
    return xent(logits, tokens)
  blocks_rest = {k: v for k, v in rest.items() if k.startswith("block_")}
  return (loss_qlora, ad, {"layers": frozen["layers"], "rest": rest},
          _nbytes(frozen["layers"]) + _nbytes(blocks_rest))


def measure(name, shape, rank, optim, text, base_params, steps, repeats) -> dict:
  loss_fn, trainable, fixed, base_bytes = setup(name, shape, rank, base_params)
  tx = optim.tx()

  def loop(p, s, fixed, text, key, n):
    def one(i, carry):
      p, s, key, _ = carry
      key, k = jax.random.split(key)
      tokens = lm_step.sample_windows(text, k, shape.batch, shape.seq)
      loss, g = jax.value_and_grad(loss_fn)(p, fixed, tokens)
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s, key, loss
    p, s, _, loss = jax.lax.fori_loop(0, n, one, (p, s, key, jnp.zeros((), jnp.float32)))
    return p, s, loss

  jitted = jax.jit(loop, donate_argnums=(0, 1))
  s0 = optim.init(trainable)
  t0 = time.perf_counter()
  compiled = jitted.lower(trainable, s0, fixed, text, jax.random.key(0), jnp.int32(1)).compile()
  compile_s = time.perf_counter() - t0
  mem = lm_step._memory(compiled)
  fresh = lambda t: jax.block_until_ready(jax.tree.map(jnp.copy, t))
  run = lambda p, s, key: jax.block_until_ready(compiled(p, s, fixed, text, key,
                                                         jnp.int32(steps)))
  out = run(fresh(trainable), optim.init(trainable), jax.random.key(1))
  times = []
  for r in range(repeats):
    p, s = fresh(trainable), jax.block_until_ready(optim.init(trainable))
    t = time.perf_counter()
    out = run(p, s, jax.random.key(2 + r))
    times.append((time.perf_counter() - t) / steps)
  ms = statistics.median(times) * 1e3
  return dict(ms=ms, tokens_per_s=shape.tokens / (ms / 1e3), compile_s=compile_s,
              mem_bytes=(mem or {}).get("peak"), memory=mem, base_bytes=base_bytes,
              trainable_params=int(sum(np.prod(np.shape(x)) for x in jax.tree.leaves(trainable))),
              trainable_bytes=_nbytes(trainable) + _nbytes(s0), loss=float(out[2]))


def main(argv=None) -> list[dict]:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  lm_step.add_model_arguments(ap, widths="2048")
  ap.add_argument("--rank", type=int, default=16, help="adapter rank (alpha = 2 x rank)")
  ap.add_argument("--configs", default=",".join(CONFIGS),
                  help="comma-separated; " + "; ".join(f"{k}: {v}" for k, v in CONFIGS.items()))
  _record.add_arguments(ap)
  args = ap.parse_args(argv)
  names = [c for c in args.configs.split(",") if c]
  unknown = [c for c in names if c not in CONFIGS]
  if unknown:
    ap.error(f"--configs: unknown {unknown}; valid: {', '.join(CONFIGS)}")
  if BASELINE in names:
    names = [BASELINE] + [n for n in names if n != BASELINE]
  if args.rank < 1 or min(args.steps, args.repeats) < 1:
    ap.error("--rank, --steps and --repeats must be >= 1")
  widths = [int(v) for v in args.widths.split(",") if v]
  layers = lm_step.parse_layers(args.layers, widths)
  text = lm_step.load_text(args.text, args.seq + 1, accuracy=False)
  train = jnp.asarray(text.train)
  optim = lm_step.Optim(lr=args.lr, schedule_steps=200)
  rec = _record.Recorder("lora_step", dict(
      widths=widths, seq=args.seq, batch=args.batch, rank=args.rank, alpha=2.0 * args.rank,
      steps=args.steps, repeats=args.repeats, optimizer=optim.describe(), text=text.source),
      out_dir=args.out_dir, results=args.results)
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; rank {args.rank}", flush=True)
  rows = []
  for w, n_layers in zip(widths, layers):
    heads = lm_step.heads_for(w, args.head_dim)
    shape = lm_step.Shape(width=w, layers=n_layers, heads=heads, seq=args.seq, batch=args.batch,
                          attention=lm_step.resolve_attention(args.attention, heads,
                                                              min(w, args.head_dim), args.seq))
    base_params = lm_step.init_params(shape, 0)
    base = None
    for name in names:
      row = dict(config=name, d_model=w, layers=n_layers, seq=args.seq, batch=args.batch,
                 rank=args.rank, tokens_per_step=shape.tokens, attention=shape.attention)
      try:
        with warnings.catch_warnings():
          warnings.filterwarnings("ignore", message=".*donated buffers were not usable.*")
          fig = measure(name, shape, args.rank, optim, train, base_params, args.steps,
                        args.repeats)
      except Exception as e:  # one config failing must not hide the others
        print(f"{name} d={w}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        rows.append(dict(row, ms=None, error=f"{type(e).__name__}: {str(e)[:200]}"))
        rec.write(rows)
        continue
      if name == BASELINE:
        base = fig
      ratio = lambda a, b: a / b if a is not None and b else None
      row.update(fig, vs_lora_bf16=ratio(base and base["ms"], fig["ms"]),
                 mem_vs_lora_bf16=ratio(fig["mem_bytes"], base and base["mem_bytes"]))
      rows.append(row)
      mem = "?" if fig["mem_bytes"] is None else f"{fig['mem_bytes'] / 2**30:.3f}"
      print(f"{name:15s} d={w} L={n_layers} {fig['ms']:9.2f} ms/step  "
            f"{lm_step._fmt(row['vs_lora_bf16'], '5.2f')}x  peak {mem} GiB  base "
            f"{fig['base_bytes'] / 2**20:.1f} MiB  trainable {fig['trainable_params']:,}  "
            f"compile {fig['compile_s']:.1f} s  loss {fig['loss']:.4f}", flush=True)
      rec.write(rows)
  rec.finish(rows)
  return rows


if __name__ == "__main__":
  main()
