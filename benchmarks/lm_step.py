"""Language-model training benchmark: a GPT-style byte-level decoder, bf16 vs quantized training.

The model (linen, flax's own layers): token embedding (vocab 256: bytes; ``nn.Embed``'s
parameter, looked up as a product of one-hot rows with it unless ``--embedding take``) plus a
learned position embedding, ``L`` pre-LayerNorm blocks of ``nn.MultiHeadDotProductAttention``
(causal, head dim 128, biases) and an MLP ``Dense(d -> 4d) -> gelu -> Dense(4d -> d)``, a
final LayerNorm and a ``Dense(d -> 256)`` head. bf16 activations and parameters (initialised
in float32, then cast: flax's initialisers run in bf16 give a handful of distinct values).
AdamW (b1 0.9, b2 0.95, weight decay 0.1, global-norm clip 1.0, float32 moments, warmup +
cosine schedule) identical for every config; every config starts from the same float init
and sees the same data.

What the quantized configs quantize: every ``dot_general`` under ``block_<i>/``, i.e. the
attention's query / key / value / out projections (``DenseGeneral``) and both MLP ``Dense``
layers. Float in every config: the attention's score and value products (activation x
activation; flax's einsums, or the fused kernel below), the embeddings (lookups) and the head
``Dense`` (first and last layers stay float, as usual in quantized training), LayerNorm and
the loss. The configs (``CONFIGS``):

  bf16          no quantization
  qtrain_int8   w8a8, int8 gradients, low_bit_uniform SR (train_step.py's qtrain_int8_lowbit)
  qtrain_int8_hash  qtrain_int8 with low_bit_hash SR (the noise from a keyed hash, no PRNG)
  qtrain_fp8    e4m3 forward, e5m2 gradients, low_bit_uniform SR (train_step's qtrain_fp8_lowbit)
  qtrain_w1a8   binary weights (absmean scale per output channel), int8 activations, int8
                gradients with low_bit_uniform SR
  qtrain_int4w  int4 weights (per output channel), int8 activations, int8 gradients with
                low_bit_uniform SR: with int8 activations the products run as int8 x int8 on
                the tensor cores (bf16 activations would dequantize the weight into a bf16
                GEMM, no faster than bf16); qtrain supports both
  qtrain_w1a8_hash, qtrain_int4w_hash  the same with low_bit_hash SR
  qwix_int8     qwix: w8a8, int8 gradients, uniform SR (train_step.py's qwix_int8)
  qwix_fp8      qwix: e4m3 forward, e5m2 gradients, round to nearest (train_step's qwix_fp8)

The qwix rules are restricted to ``dot_general`` like qtrain's, so qwix, which quantizes an
einsum of two activations when a rule matches it, leaves the attention products float too.

Attention (``--attention``): ``flax`` is flax's ``dot_product_attention`` (scores materialised,
causal mask); ``cudnn`` / ``xla`` pass ``jax.nn.dot_product_attention(is_causal=True)`` to
flax's layer as its ``attention_fn`` (``cudnn``: the fused flash-attention kernel); ``auto``
(default) is ``cudnn`` on a GPU (``xla`` if a probe of the cuDNN kernel fails there) and
``flax`` elsewhere. The attention used is recorded in every row.

Per config and width: compile seconds (``lower`` + ``compile`` of the training loop, taken
apart from the timing), ms/step (``--steps`` steps inside ONE jit: a ``lax.fori_loop``
carrying params and optimizer state and drawing its batches inside the loop; median of
``--repeats``), tokens/s, peak device memory of the compiled loop (``memory_analysis()``:
arguments + outputs - donated aliases + temporaries; deterministic and per program, unlike
the process-wide ``peak_bytes_in_use``, which this script does not record) and, with
``--loss-seeds K``, the held-out loss after ``--loss-steps`` training steps from K seeds
(accuracy mode: same compiled loop, K fresh inits; the timing mode stays cheap without it).
Batches are random windows of ``--seq + 1`` bytes of ``--text`` (the first 90% for training,
the last 10% held out); default text ``../shared/data/text/fortunes.txt`` beside the
repository (or ``shared/`` or ``.data/`` inside it, for a copied work tree), else a generated
text (a printed note; the accuracy mode then refuses unless ``--text generated`` asks for it).

Defaults: ``--widths 1024,2048``, layers per width 8 / 4 / 2 at d_model 1024 / 2048 / 4096
(``--layers auto``: ``clamp(8192 // d, 1, 8)``), ``--seq 2048 --batch 8`` (16,384 tokens per
step), ``--steps 10 --repeats 3``, all configs (bf16 first: the ratios' baseline).

On the GPU machine (benchmarks/gpu.sh parts ``lm`` and ``lm-loss``; qwix from .whl/):

  python3 benchmarks/lm_step.py --widths 1024,2048 --budget-s 520 --out-dir $OUT
  python3 benchmarks/lm_step.py --widths 1024 --loss-seeds 2 --loss-steps 200 \\
      --configs bf16,qtrain_int8,qtrain_fp8 --text .data/fortunes.txt --out-dir $OUT

Prints a markdown table, writes the run's JSON record after every config (a run cut by a
timeout keeps what it measured) and, on a GPU with the record in benchmarks/records/,
rebuilds the ``lm_step`` table of benchmarks/RESULTS.md (benchmarks/_record.py).

On a CPU (tiny sizes; never into RESULTS.md):

  python3 benchmarks/lm_step.py --widths 64 --layers 1 --seq 64 --batch 2 --steps 2 \\
      --repeats 1 --configs bf16,qtrain_int8,qtrain_fp8,qtrain_w1a8,qtrain_int4w
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import importlib.util
import os
import statistics
import sys
import time
import warnings
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import qtrain  # noqa: E402
from benchmarks import _record  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Where the default text is looked for, in order: beside the checkout (this machine), inside a
# copied work tree (the GPU machine gets only the repository: copy the file into an ignored
# .data/ and carry it, or ship a shared/ folder inside the tree).
TEXT_CANDIDATES = (os.path.join(REPO, "..", "shared", "data", "text", "fortunes.txt"),
                   os.path.join(REPO, "shared", "data", "text", "fortunes.txt"),
                   os.path.join(REPO, ".data", "fortunes.txt"))
VOCAB = 256  # bytes

CONFIGS = {
    "bf16": "no quantization",
    "qtrain_int8": "w8a8, int8 gradients, low_bit_uniform SR",
    "qtrain_int8_hash": "w8a8, int8 gradients, low_bit_hash SR (noise from a keyed hash, no PRNG)",
    "qtrain_fp8": "e4m3 forward, e5m2 gradients, low_bit_uniform SR",
    "qtrain_w1a8": "binary weights (absmean), int8 activations, int8 gradients, low_bit_uniform SR",
    "qtrain_int4w": "int4 weights (per channel), int8 activations, int8 gradients, low_bit_uniform SR",
    "qtrain_w1a8_hash": "qtrain_w1a8 with low_bit_hash SR",
    "qtrain_int4w_hash": "qtrain_int4w with low_bit_hash SR",
    "qwix_int8": "qwix: w8a8, int8 gradients, uniform SR",
    "qwix_fp8": "qwix: e4m3 forward, e5m2 gradients (qwix has no SR for fp8)",
}
ATTENTIONS = ("auto", "flax", "cudnn", "xla")

# Every quantized config: the dot_generals of the decoder blocks (attention projections, MLP).
_BLOCKS = dict(module_path=r"block_\d+/.*", op_names=("dot_general",))
_INT8_GRADS = dict(bwd_qtype="int8", bwd_stochastic_rounding="low_bit_uniform")


def qtrain_rules(name: str) -> list[qtrain.QtRule]:
  if name == "qtrain_int8":
    return [qtrain.QtRule(**_BLOCKS, weight_qtype="int8", act_qtype="int8", **_INT8_GRADS)]
  if name == "qtrain_int8_hash":
    return [qtrain.QtRule(**_BLOCKS, weight_qtype="int8", act_qtype="int8", bwd_qtype="int8",
                          bwd_stochastic_rounding="low_bit_hash")]
  if name == "qtrain_fp8":
    return [qtrain.QtRule(**_BLOCKS, weight_qtype="float8_e4m3fn", act_qtype="float8_e4m3fn",
                          bwd_qtype="float8_e5m2", bwd_stochastic_rounding="low_bit_uniform")]
  grads = (dict(_INT8_GRADS, bwd_stochastic_rounding="low_bit_hash") if name.endswith("_hash")
           else _INT8_GRADS)
  if name in ("qtrain_w1a8", "qtrain_w1a8_hash"):
    # absmean: the scale that minimises the binary weight's L2 error (XNOR-Net); absmax
    # would scale every sign to the row's largest weight.
    return [qtrain.QtRule(**_BLOCKS, weight_qtype="binary", weight_calibration_method="absmean",
                          act_qtype="int8", **grads)]
  if name in ("qtrain_int4w", "qtrain_int4w_hash"):
    # Per channel, not tiled: 'auto' sends integer products with per-row x per-column scales
    # to the int8 GEMM (the Mosaic GEMM on Hopper); a tiled weight would stay on XLA.
    return [qtrain.QtRule(**_BLOCKS, weight_qtype="int4", act_qtype="int8", **grads)]
  raise ValueError(name)


def qwix_model(model: nn.Module, name: str) -> nn.Module:
  """The qwix twin of a config: train_step.py's qwix rules, restricted to the blocks'
  dot_generals (qwix would otherwise quantize the attention's activation x activation
  einsums, which qtrain leaves float)."""
  import qwix  # carried as a wheel (gpu.sh installs it into /tmp/site)
  if name == "qwix_int8":
    rule = qwix.QtRule(**_BLOCKS, weight_qtype="int8", act_qtype="int8", bwd_qtype="int8",
                       bwd_stochastic_rounding="uniform")
  elif name == "qwix_fp8":
    rule = qwix.QtRule(**_BLOCKS, weight_qtype="float8_e4m3fn", act_qtype="float8_e4m3fn",
                       bwd_qtype="float8_e5m2")
  else:
    raise ValueError(name)
  return qwix.quantize_model(model, qwix.QtProvider([rule]))


def qwix_missing() -> str | None:
  """Why the qwix configs cannot run here, or None."""
  if importlib.util.find_spec("qwix") is None:
    return ("qwix is not importable (benchmarks/gpu.sh installs it from a wheel in .whl/ "
            "into /tmp/site)")
  return None


# ---------------------------------------------------------------------------------------------
# The model


def jax_attention(implementation: str) -> Callable:
  """An ``attention_fn`` for flax's layer: ``jax.nn.dot_product_attention``, causal.

  flax passes only the keyword arguments this signature names (``mask``, ``dtype``); the mask
  is None here (causality is ``is_causal``, which lets cuDNN skip the masked blocks)."""
  def attention_fn(query, key, value, mask=None, dtype=None):
    del mask, dtype
    return jax.nn.dot_product_attention(query, key, value, is_causal=True,
                                        implementation=implementation)
  return attention_fn


class Block(nn.Module):
  width: int
  heads: int
  attention: str  # "flax", "cudnn" or "xla"

  @nn.compact
  def __call__(self, x):
    bf16 = jnp.bfloat16
    kw = {} if self.attention == "flax" else {"attention_fn": jax_attention(self.attention)}
    # One (1, 1, T, T) mask broadcast over the batch (not a (B, 1, T, T) constant).
    mask = nn.make_causal_mask(jnp.ones((1, x.shape[1])), dtype=jnp.bool_) \
        if self.attention == "flax" else None
    h = nn.LayerNorm(dtype=bf16, name="ln_attn")(x)
    x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads, dtype=bf16, deterministic=True,
                                            name="attn", **kw)(h, h, mask=mask)
    h = nn.LayerNorm(dtype=bf16, name="ln_mlp")(x)
    h = nn.gelu(nn.Dense(4 * self.width, dtype=bf16, name="mlp_up")(h))
    return x + nn.Dense(self.width, dtype=bf16, name="mlp_down")(h)


class OneHotEmbed(nn.Embed):
  """``nn.Embed`` (same parameter) whose lookup is a product of one-hot rows with the table.

  The lookup is exact (one nonzero term per output); its gradient is a (vocab x tokens) x
  (tokens x d_model) GEMM, where ``nn.Embed``'s take has a scatter-add of every token's row
  into the table. With 256 byte values, 16,384 rows contend for 256 entries: at d_model 2048 on
  an H200 that scatter-add took 6.4-7.7 ms of every config's step, and this lookup took bf16's
  step from 43.98 to 38.4-39.4 ms.
  """

  def __call__(self, inputs: jax.Array) -> jax.Array:
    if not jnp.issubdtype(inputs.dtype, jnp.integer):
      raise ValueError(f"OneHotEmbed: token ids must be integers, got dtype {inputs.dtype}")
    table = jnp.asarray(self.embedding, self.dtype)
    return jnp.dot(jax.nn.one_hot(inputs, self.num_embeddings, dtype=table.dtype), table,
                   preferred_element_type=jnp.float32).astype(table.dtype)


EMBEDDINGS = {"onehot": OneHotEmbed, "take": nn.Embed}


class Decoder(nn.Module):
  width: int
  layers: int
  heads: int
  seq: int
  attention: str
  embedding: str = "take"  # a key of EMBEDDINGS

  @nn.compact
  def __call__(self, tokens):
    bf16 = jnp.bfloat16
    x = EMBEDDINGS[self.embedding](VOCAB, self.width, dtype=bf16, name="embed")(tokens)
    x = x + nn.Embed(self.seq, self.width, dtype=bf16, name="pos")(jnp.arange(tokens.shape[1]))
    for i in range(self.layers):
      x = Block(self.width, self.heads, self.attention, name=f"block_{i}")(x)
    x = nn.LayerNorm(dtype=bf16, name="ln_f")(x)
    return nn.Dense(VOCAB, dtype=bf16, name="head")(x)


@dataclasses.dataclass(frozen=True)
class Shape:
  """One model and batch shape (every config of a width runs the same)."""
  width: int
  layers: int
  heads: int
  seq: int
  batch: int
  attention: str
  embedding: str = "take"

  @property
  def tokens(self) -> int:
    return self.batch * self.seq

  def decoder(self) -> Decoder:
    return Decoder(self.width, self.layers, self.heads, self.seq, self.attention,
                   self.embedding)


def build(name: str, shape: Shape) -> tuple[nn.Module, str | None]:
  """(model, the RNG stream its stochastic rounding draws from, or None)."""
  model = shape.decoder()
  if name == "bf16":
    return model, None
  if name.startswith("qwix"):
    return qwix_model(model, name), "stochastic_rounding" if name == "qwix_int8" else None
  return qtrain.quantize_model(model, qtrain.QtProvider(qtrain_rules(name))), qtrain.RNG_STREAM


def heads_for(width: int, head_dim: int) -> int:
  """``width // head_dim`` heads (one head of ``width`` below ``head_dim``).

  >>> heads_for(2048, 128), heads_for(64, 128)
  (16, 1)
  """
  if width <= head_dim:
    return 1
  if width % head_dim:
    raise ValueError(f"d_model {width} is not a multiple of --head-dim {head_dim}")
  return width // head_dim


def auto_layers(width: int) -> int:
  """The default depth per width: 8 / 4 / 2 layers at d_model 1024 / 2048 / 4096.

  >>> [auto_layers(d) for d in (64, 1024, 2048, 4096, 8192)]
  [8, 8, 4, 2, 1]
  """
  return max(1, min(8, 8192 // width))


# ---------------------------------------------------------------------------------------------
# Data


@dataclasses.dataclass(frozen=True)
class Text:
  """Byte tokens: a training split, a held-out split and where they came from."""
  train: np.ndarray  # uint8
  heldout: np.ndarray  # uint8
  source: str
  nbytes: int
  sha256: str


def generated_text(nbytes: int = 1 << 20) -> bytes:
  """A deterministic English-like text (word salad over a fixed vocabulary) for timing runs
  where no real text is at hand."""
  words = ("the of and to in is was that for it with as his on be at by had are but from or "
           "not this have an they which one you were her all she there would their we him been "
           "has when who will more no if out so said what up its about into than them can only "
           "other new some could time these two may then do first any my now such like our over "
           "man me even most made after also did many before must through back years where much "
           "your way well down should because each just those people how too little state good "
           "very make world still own see men work long get here between both life being under "
           "never day same another know while last might us great old year off come since against "
           "go came right used take three").split()
  rng = np.random.default_rng(0)
  out, size = [], 0
  while size < nbytes:
    n = int(rng.integers(4, 16))
    sentence = " ".join(words[i] for i in rng.integers(0, len(words), n))
    sentence = sentence[0].upper() + sentence[1:] + rng.choice([". ", ". ", "? ", "!\n", ".\n"])
    out.append(sentence)
    size += len(sentence)
  return "".join(out).encode()[:nbytes]


def find_text() -> str | None:
  return next((p for p in TEXT_CANDIDATES if os.path.isfile(p)), None)


def load_text(spec: str | None, need: int, *, accuracy: bool) -> Text:
  """``spec``: a path, ``"generated"``, or None (the default search, TEXT_CANDIDATES).

  The last 10% is held out. ``need``: the bytes one window takes (seq + 1); each split must
  hold one. The accuracy mode refuses the generated text unless asked for by name."""
  path = find_text() if spec is None else (None if spec == "generated" else spec)
  if path is None:
    if accuracy and spec is None:
      raise SystemExit("no real text found (looked for " + ", ".join(TEXT_CANDIDATES) + "): the "
                       "accuracy mode needs one; pass --text PATH (or --text generated)")
    if spec is None:
      print("note: no text found (" + ", ".join(os.path.relpath(p) for p in TEXT_CANDIDATES) +
            "); using a generated text (fine for timing, not for the loss)", flush=True)
    data, source = generated_text(), "generated"
  else:
    with open(path, "rb") as f:
      data = f.read()
    source = os.path.relpath(os.path.realpath(path), REPO)
  arr = np.frombuffer(data, np.uint8)
  split = int(len(arr) * 0.9)
  train, heldout = arr[:split], arr[split:]
  if min(len(train), len(heldout)) < need:
    raise SystemExit(f"--text {source}: {len(arr)} bytes; its 90% / 10% splits need at least "
                     f"{need} bytes each (--seq + 1)")
  return Text(train=train, heldout=heldout, source=source, nbytes=len(arr),
              sha256=hashlib.sha256(data).hexdigest()[:16])


def sample_windows(text: jax.Array, key: jax.Array, batch: int, seq: int) -> jax.Array:
  """``batch`` random windows of ``seq + 1`` tokens (inputs and next-token targets), int32."""
  starts = jax.random.randint(key, (batch,), 0, text.shape[0] - seq)
  return text[starts[:, None] + jnp.arange(seq + 1)].astype(jnp.int32)


def eval_windows(heldout: np.ndarray, n: int, seq: int) -> np.ndarray:
  """``n`` evenly spaced held-out windows of ``seq + 1`` tokens (the same for every config)."""
  starts = np.linspace(0, len(heldout) - seq - 1, n).astype(np.int64)
  return np.stack([heldout[s:s + seq + 1] for s in starts]).astype(np.int32)


# ---------------------------------------------------------------------------------------------
# Training


@dataclasses.dataclass(frozen=True)
class Optim:
  """AdamW with float32 moments and a warmup + cosine schedule over ``schedule_steps``."""
  lr: float
  schedule_steps: int
  b1: float = 0.9
  b2: float = 0.95
  weight_decay: float = 0.1
  clip: float = 1.0

  @property
  def warmup(self) -> int:
    return max(1, self.schedule_steps // 10)

  def tx(self) -> optax.GradientTransformation:
    sched = optax.warmup_cosine_decay_schedule(0.0, self.lr, self.warmup, self.schedule_steps,
                                               end_value=self.lr / 10)
    return optax.chain(optax.clip_by_global_norm(self.clip),
                       optax.adamw(sched, b1=self.b1, b2=self.b2, weight_decay=self.weight_decay,
                                   mu_dtype=jnp.float32))

  def init(self, params) -> Any:
    # From float32 copies: adam's second moment takes the params' dtype, and bf16 moments
    # would lose the small updates. Updates come out float32; apply_updates rounds the sum
    # into the bf16 params.
    return self.tx().init(jax.tree.map(lambda p: p.astype(jnp.float32), params))

  def describe(self) -> str:
    return (f"adamw(lr {self.lr:g}, warmup {self.warmup} + cosine to {self.lr / 10:g} over "
            f"{self.schedule_steps} steps, b1 {self.b1}, b2 {self.b2}, wd {self.weight_decay}, "
            f"float32 moments), clip_by_global_norm({self.clip})")


@functools.lru_cache(maxsize=None)
def _jitted_init(shape: Shape) -> Callable:
  return jax.jit(shape.decoder().init)  # one compile per shape, whatever the seeds


def init_params(shape: Shape, seed: int) -> Any:
  """The float model's params for ``seed``: float32 init, cast to bf16. Every config of a
  width starts from these (the quantized models here add no params of their own)."""
  tokens = jnp.zeros((1, shape.seq), jnp.int32)
  params = _jitted_init(shape)(jax.random.fold_in(jax.random.key(seed), 0), tokens)["params"]
  return jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)


@dataclasses.dataclass(frozen=True)
class Program:
  """One config's compiled training loop and its figures from the compiler."""
  loop: Callable  # (params, opt_state, text, key, n) -> (params, opt_state, last loss); donates 0, 1
  loss: Callable  # (params, windows) -> mean loss (jitted forward)
  lower_s: float
  xla_compile_s: float
  memory: dict | None


def build_program(name: str, shape: Shape, optim: Optim, params, text: jax.Array, *,
                  data_sharding=None) -> Program:
  """``data_sharding``: a sharding the loop's token batches are constrained to (data
  parallelism over several devices, benchmarks/scaling.py); None: as XLA places them."""
  model, stream = build(name, shape)
  tx = optim.tx()

  def loss_fn(p, tokens, key):
    kw = {"rngs": {stream: key}} if stream else {}
    logits = model.apply({"params": p}, tokens[:, :-1], **kw)
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                           tokens[:, 1:]).mean()

  def loop(p, s, text, key, n):
    # n is traced: one compile serves the timed runs and the accuracy mode's longer run.
    def one_step(i, carry):
      p, s, key, _ = carry
      key, k_data, k_sr = jax.random.split(key, 3)
      tokens = sample_windows(text, k_data, shape.batch, shape.seq)
      if data_sharding is not None:
        tokens = jax.lax.with_sharding_constraint(tokens, data_sharding)
      loss, g = jax.value_and_grad(loss_fn)(p, tokens, k_sr)
      updates, s = tx.update(g, s, p)
      return optax.apply_updates(p, updates), s, key, loss
    p, s, _, loss = jax.lax.fori_loop(0, n, one_step, (p, s, key, jnp.zeros((), jnp.float32)))
    return p, s, loss

  def eval_loss(p, windows):
    batches = windows.reshape(-1, shape.batch, windows.shape[-1])
    return jnp.mean(jax.lax.map(lambda w: loss_fn(p, w, jax.random.key(0)), batches))

  # Params and optimizer state are donated, as a training loop would: the memory figure is
  # then that of a real step (no second copy of the state).
  jitted = jax.jit(loop, donate_argnums=(0, 1))
  t0 = time.perf_counter()
  lowered = jitted.lower(params, optim.init(params), text, jax.random.key(0), jnp.int32(1))
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  return Program(loop=compiled, loss=jax.jit(eval_loss), lower_s=t1 - t0, xla_compile_s=t2 - t1,
                 memory=_memory(compiled))


def _memory(compiled) -> dict | None:
  """The compiled program's memory: its arguments, outputs not aliased to donated
  arguments, and temporaries, live at once at worst (None where the backend has no analysis)."""
  try:
    m = compiled.memory_analysis()
  except (NotImplementedError, AttributeError, RuntimeError):
    return None
  if m is None:
    return None
  parts = {k: int(getattr(m, f"{k}_size_in_bytes", 0) or 0)
           for k in ("argument", "output", "alias", "temp", "generated_code")}
  parts["peak"] = parts["argument"] + parts["output"] - parts["alias"] + parts["temp"]
  return parts


def _fresh(tree):
  """A device copy (the loop donates its params and state)."""
  return jax.block_until_ready(jax.tree.map(jnp.copy, tree))


def run_loop(prog: Program, params, opt_state, text, key, n: int):
  return jax.block_until_ready(prog.loop(params, opt_state, text, key, jnp.int32(n)))


@dataclasses.dataclass(frozen=True)
class Plan:
  """What to measure per config (from the command line)."""
  steps: int
  repeats: int
  optim: Optim
  loss_steps: int
  loss_seeds: int
  eval_windows: int


def measure(name: str, shape: Shape, plan: Plan, text: Text, inits: Callable[[int], Any]) -> dict:
  """Compile, time and (accuracy mode) train one config; returns its row's figures."""
  train = jnp.asarray(text.train)
  params = inits(0)
  prog = build_program(name, shape, plan.optim, params, train)
  # Warm-up: the first run of an executable pays one-time costs (allocation, autotuning's
  # leftovers); then the timed repeats, each from fresh copies of the same state.
  out = run_loop(prog, _fresh(params), plan.optim.init(params), train, jax.random.key(1),
                 plan.steps)
  times = []
  for r in range(plan.repeats):
    p, s = _fresh(params), jax.block_until_ready(plan.optim.init(params))
    t0 = time.perf_counter()
    out = run_loop(prog, p, s, train, jax.random.key(2 + r), plan.steps)
    times.append((time.perf_counter() - t0) / plan.steps)
  ms = statistics.median(times) * 1e3
  row = dict(ms=ms, tokens_per_s=shape.tokens / (ms / 1e3), lower_s=prog.lower_s,
             xla_compile_s=prog.xla_compile_s, compile_s=prog.lower_s + prog.xla_compile_s,
             mem_bytes=(prog.memory or {}).get("peak"), memory=prog.memory,
             timing_loss=float(out[2]), loss=None)
  if plan.loss_seeds:
    windows = jnp.asarray(eval_windows(text.heldout, plan.eval_windows, shape.seq))
    losses, train_losses = [], []
    for seed in range(plan.loss_seeds):
      p0 = inits(seed)
      p, _, last = run_loop(prog, _fresh(p0), plan.optim.init(p0), train,
                            jax.random.fold_in(jax.random.key(seed), 1), plan.loss_steps)
      losses.append(float(prog.loss(p, windows)))
      train_losses.append(float(last))
    row.update(loss=statistics.fmean(losses), losses=losses,
               loss_std=statistics.stdev(losses) if len(losses) > 1 else None,
               train_loss=statistics.fmean(train_losses), loss_steps=plan.loss_steps,
               loss_seeds=plan.loss_seeds)
  return row


# ---------------------------------------------------------------------------------------------
# Command line


def resolve_attention(requested: str, heads: int, head_dim: int, seq: int) -> str:
  """``auto``: cuDNN's fused attention on a GPU if a small probe of it (forward and
  backward) compiles and runs, else jax's XLA attention there; flax's elsewhere."""
  if requested != "auto":
    return requested
  if jax.devices()[0].platform != "gpu":
    return "flax"
  q = jnp.zeros((1, min(seq, 256), heads, head_dim), jnp.bfloat16)
  f = lambda q: jax.nn.dot_product_attention(q, q, q, is_causal=True,
                                             implementation="cudnn").astype(jnp.float32).sum()
  try:
    jax.block_until_ready(jax.jit(jax.grad(f))(q))
    return "cudnn"
  except Exception as e:  # any failure: the XLA path runs everywhere
    print(f"note: cuDNN attention unavailable ({type(e).__name__}: {str(e)[:200]}); "
          "using --attention xla", flush=True)
    return "xla"


def parse_layers(spec: str, widths: list[int]) -> list[int]:
  """``auto``, one depth for every width, or one per width.

  >>> parse_layers("auto", [1024, 2048]), parse_layers("2", [64, 128]), parse_layers("8,4", [1, 2])
  ([8, 4], [2, 2], [8, 4])
  """
  if spec == "auto":
    return [auto_layers(w) for w in widths]
  vals = [int(v) for v in spec.split(",")]
  if len(vals) == 1:
    return vals * len(widths)
  if len(vals) != len(widths):
    raise ValueError(f"--layers {spec}: one value, or one per width ({len(widths)})")
  return vals


def _fmt(v, spec: str) -> str:
  return "" if v is None else format(v, spec)


def add_model_arguments(ap: argparse.ArgumentParser, *, widths: str) -> None:
  """The decoder, batch, timing, text and learning-rate options (lm_step.py, lora_step.py)."""
  ap.add_argument("--widths", default=widths, help="d_model values (comma-separated)")
  ap.add_argument("--layers", default="auto",
                  help="decoder blocks: 'auto' (8 / 4 / 2 at d_model 1024 / 2048 / 4096), N, or "
                       "one per width")
  ap.add_argument("--head-dim", type=int, default=128, help="attention head size")
  ap.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
  ap.add_argument("--batch", type=int, default=8, help="sequences per step")
  ap.add_argument("--attention", default="auto", choices=ATTENTIONS,
                  help="flax: flax's dot_product_attention; cudnn / xla: jax.nn."
                       "dot_product_attention as flax's attention_fn; auto: cudnn on a GPU, "
                       "flax elsewhere")
  ap.add_argument("--embedding", default="onehot", choices=tuple(EMBEDDINGS),
                  help="the token embedding's lookup: onehot (a one-hot product: its gradient "
                       "is a GEMM) or take (nn.Embed: its gradient a scatter-add)")
  ap.add_argument("--steps", type=int, default=10, help="timed steps inside one jit")
  ap.add_argument("--repeats", type=int, default=3, help="timed repeats (median reported)")
  ap.add_argument("--text", default=None,
                  help="a text file (bytes are the tokens), or 'generated'; default: "
                       "../shared/data/text/fortunes.txt beside the repository, or "
                       "shared/data/text/fortunes.txt or .data/fortunes.txt inside it")
  ap.add_argument("--lr", type=float, default=1e-3, help="AdamW's peak learning rate")


def main(argv: list[str] | None = None) -> list[dict]:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  add_model_arguments(ap, widths="1024,2048")
  ap.add_argument("--configs", default=",".join(CONFIGS),
                  help="comma-separated; " + "; ".join(f"{k}: {v}" for k, v in CONFIGS.items()))
  ap.add_argument("--loss-steps", type=int, default=200,
                  help="the accuracy mode's training steps (also the schedule's length in "
                       "the timed runs)")
  ap.add_argument("--loss-seeds", type=int, default=0,
                  help="accuracy mode: train --loss-steps steps from this many seeds (init and "
                       "data order) per config and report the held-out loss; 0: timing only")
  ap.add_argument("--eval-batches", type=int, default=4,
                  help="held-out batches (of --batch windows) the loss is taken over")
  ap.add_argument("--budget-s", type=float, default=0,
                  help="start no new config after this many seconds (0: no limit)")
  _record.add_arguments(ap)
  args = ap.parse_args(argv)
  t_start = time.perf_counter()
  names = [c for c in args.configs.split(",") if c]
  unknown = [c for c in names if c not in CONFIGS]
  if unknown:
    ap.error(f"--configs: unknown {unknown}; valid: {', '.join(CONFIGS)}")
  if "bf16" in names:  # the baseline first
    names = ["bf16"] + [n for n in names if n != "bf16"]
  widths = [int(v) for v in args.widths.split(",") if v]
  try:
    layers = parse_layers(args.layers, widths)
    heads = [heads_for(w, args.head_dim) for w in widths]
  except ValueError as e:
    ap.error(str(e))
  if min(args.steps, args.repeats, args.batch, args.seq, args.loss_steps, args.eval_batches) < 1:
    ap.error("--steps, --repeats, --batch, --seq, --loss-steps and --eval-batches must be >= 1")
  text = load_text(args.text, args.seq + 1, accuracy=args.loss_seeds > 0)
  plan = Plan(steps=args.steps, repeats=args.repeats,
              optim=Optim(lr=args.lr, schedule_steps=args.loss_steps),
              loss_steps=args.loss_steps, loss_seeds=args.loss_seeds,
              eval_windows=args.eval_batches * args.batch)
  attention = {w: resolve_attention(args.attention, h, min(w, args.head_dim), args.seq)
               for w, h in zip(widths, heads)}
  rec = _record.Recorder("lm_step", dict(
      widths=widths, layers=dict(zip(map(str, widths), layers)), head_dim=args.head_dim,
      seq=args.seq, batch=args.batch, tokens_per_step=args.seq * args.batch,
      attention=args.attention, embedding=args.embedding, steps=args.steps, repeats=args.repeats,
      optimizer=plan.optim.describe(), text=text.source, text_bytes=text.nbytes,
      text_sha256=text.sha256, loss_steps=args.loss_steps if args.loss_seeds else None,
      loss_seeds=args.loss_seeds, eval_windows=plan.eval_windows if args.loss_seeds else None,
      budget_s=args.budget_s or None), out_dir=args.out_dir, results=args.results)
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; text {text.source} "
        f"({text.nbytes:,} bytes); {plan.optim.describe()}", flush=True)
  skip_qwix = qwix_missing()
  rows: list[dict] = []
  for w, n_layers, n_heads in zip(widths, layers, heads):
    shape = Shape(width=w, layers=n_layers, heads=n_heads, seq=args.seq, batch=args.batch,
                  attention=attention[w], embedding=args.embedding)
    inits = functools.lru_cache(maxsize=None)(functools.partial(init_params, shape))
    base = None
    for name in names:
      if args.budget_s and time.perf_counter() - t_start > args.budget_s:
        print(f"{name} d={w}: not started, --budget-s {args.budget_s:g} spent", flush=True)
        continue
      row = dict(config=name, d_model=w, layers=n_layers, heads=n_heads, seq=args.seq,
                 batch=args.batch, tokens_per_step=shape.tokens, attention=shape.attention,
                 embedding=shape.embedding)
      if name.startswith("qwix") and skip_qwix:
        print(f"{name} d={w}: skipped: {skip_qwix}", flush=True)
        rows.append(dict(row, ms=None, error=f"skipped: {skip_qwix}"))
        rec.write(rows)
        continue
      try:
        with warnings.catch_warnings():
          # CPU backends may not use donated buffers; nothing to act on.
          warnings.filterwarnings("ignore", message=".*donated buffers were not usable.*")
          fig = measure(name, shape, plan, text, inits)
      except Exception as e:  # report, keep going: one config failing must not hide the others
        print(f"{name} d={w}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        rows.append(dict(row, ms=None, error=f"{type(e).__name__}: {str(e)[:200]}"))
        rec.write(rows)
        continue
      if name == "bf16":
        base = fig
      ratio = lambda a, b: a / b if a is not None and b else None
      row.update(fig, vs_bf16=ratio(base and base["ms"], fig["ms"]),
                 mem_vs_bf16=ratio(fig["mem_bytes"], base and base["mem_bytes"]),
                 compile_vs_bf16=ratio(fig["compile_s"], base and base["compile_s"]))
      rows.append(row)
      loss = f"  held-out loss {fig['loss']:.4f}" if fig["loss"] is not None else ""
      mem = f"{fig['mem_bytes'] / 2**30:8.3f} GiB" if fig["mem_bytes"] is not None else "    ? GiB"
      print(f"{name:13s} d={w:5d} L={n_layers} {fig['ms']:9.2f} ms/step "
            f"{fig['tokens_per_s']:11,.0f} tok/s {_fmt(row['vs_bf16'], '5.2f')}x  {mem}  "
            f"compile {fig['compile_s']:6.1f} s  loss {fig['timing_loss']:.4f}{loss}", flush=True)
      rec.write(rows)  # after every config: a timeout keeps what was measured
  print(f"\n{jax.devices()[0].device_kind}, jax {jax.__version__}: seq {args.seq} x batch "
        f"{args.batch}, {args.steps} steps in one jit, median of {args.repeats}\n")
  print("| config | d_model | layers | attention | ms/step | tokens/s | vs bf16 | peak GiB | "
        "vs bf16 | compile s | vs bf16 | loss |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    head = f"| {r['config']} | {r['d_model']} | {r['layers']} | {r['attention']} |"
    if r["ms"] is None:
      print(f"{head} {r['error']} | | | | | | | |")
      continue
    mem = None if r["mem_bytes"] is None else r["mem_bytes"] / 2**30
    loss = "" if r["loss"] is None else f"{r['loss']:.4f}" + (
        f" ± {r['loss_std']:.4f}" if r.get("loss_std") is not None else "")
    print(f"{head} {r['ms']:.2f} | {r['tokens_per_s']:,.0f} | {_fmt(r['vs_bf16'], '.2f')}x | "
          f"{_fmt(mem, '.3f')} | {_fmt(r['mem_vs_bf16'], '.2f')}x | {r['compile_s']:.1f} | "
          f"{_fmt(r['compile_vs_bf16'], '.2f')}x | {loss} |")
  rec.finish(rows)
  return rows


if __name__ == "__main__":
  main()
