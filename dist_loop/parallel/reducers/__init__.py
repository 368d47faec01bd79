"""Data-parallel reducers: how a sync step's gradients become its update.

`--reducer=NAME` picks one registered reducer; its `Options` dataclass (if
any) is its flags, as a mode's, model's or schedule's are:

| reducer | what each replica holds, and what travels | its flags |
|---|---|---|
| `exact` | everything; the exact all-reduce, in buckets | `--allreduce_bucket_mb` |
| `cast` | everything; the gradients cast to fp16 or bf16 | `--cast_dtype`, `--allreduce_bucket_mb` |
| `powersgd` | everything, and error feedback; low-rank factors | `--powersgd_rank`, `--powersgd_start_step` |
| `topk` | everything, and error feedback; the largest entries | `--topk_fraction` |
| `zero1`, `zero2`, `zero3` | a shard of the slots, gradients, weights | `--allreduce_bucket_mb`, `--zero_wire_dtype` |

A reducer (`replicated.py`'s `Replicated`, `sharded.py`'s `Sharded`) owns
its state, its checkpoint entries, its work around an inner loop and its
bytes and memory report; `SyncTrainer` hands it each replica's gradients.
An extension is one file: a `Compressor` registered with `compressed`
(`experiments/extensions/randomk.py`), or a `Replicated` subclass
registered with `REDUCERS.register`. A compressor registered only in
`COMPRESSORS` (before reducers existed) is a reducer of the same name.
"""

import dataclasses

from dist_loop.core import config as config_lib
from dist_loop.core.options import option
from dist_loop.core.registry import Registry
from dist_loop.parallel.compression import (COMPRESSORS, BucketOptions,
                                            cast, powersgd, topk)
from dist_loop.parallel.reducers.replicated import Replicated
from dist_loop.parallel.reducers.sharded import Sharded, Zero1, Zero2, Zero3


class _Reducers(Registry):
  """The registry, which adopts a compressor registered only in
  `COMPRESSORS` (wrapped in `Replicated.of`) when it is looked up."""

  def _adopt(self) -> None:
    for name in [n for n, e in self._entries.items()
                 if getattr(e, "adopted", False) and n not in COMPRESSORS]:
      del self._entries[name]  # Its compressor was unregistered.
    wrapped = {getattr(e, "compressor_class", None)
               for e in self._entries.values()} | set(_CAST_DTYPES.values())
    for name in COMPRESSORS.names():
      compressor = COMPRESSORS.get(name)
      if name not in self._entries and compressor not in wrapped:
        self._entries[name] = Replicated.of(compressor)
        self._entries[name].adopted = True

  def get(self, name):
    self._adopt()
    return super().get(name)

  def names(self):
    self._adopt()
    return super().names()

  def __contains__(self, name):
    self._adopt()
    return super().__contains__(name)


REDUCERS: Registry = _Reducers("reducer", "reducer")


def compressed(name: str):
  """Decorator: registers a `Compressor` as the replicated reducer `name`
  (and as compressor `name`). Returns the compressor class."""

  def register(compressor_class):
    COMPRESSORS.register(name)(compressor_class)
    REDUCERS.register(name)(Replicated.of(compressor_class))
    return compressor_class

  return register


# --cast_dtype -> the compressor.
_CAST_DTYPES = {"fp16": cast.Float16, "bf16": cast.BFloat16}


@dataclasses.dataclass(frozen=True)
class CastOptions(BucketOptions):
  """The flags of `--reducer=cast`."""

  cast_dtype: str = option(
      "bf16", "The 16-bit dtype gradients cross the wire in: fp16 (IEEE "
      "half: 5 exponent bits, may overflow) or bf16 (float32's range).",
      choices=tuple(_CAST_DTYPES))


@REDUCERS.register("exact")
class Exact(Replicated):
  """The exact all-reduce: gradients in their own dtype, in buckets."""

  Options = BucketOptions
  compressor_class = cast.Exact
  checkpoint_layout = "plain"


@REDUCERS.register("cast")
class Cast(Replicated):
  """The all-reduce in a 16-bit dtype (Horovod's `Compression.fp16`)."""

  Options = CastOptions
  checkpoint_layout = "plain"

  @classmethod
  def compressor_for(cls, options) -> type:
    return _CAST_DTYPES[options.cast_dtype]


REDUCERS.register("powersgd")(Replicated.of(powersgd.PowerSGD))
REDUCERS.register("topk")(Replicated.of(topk.TopK))
REDUCERS.register("zero1")(Zero1)
REDUCERS.register("zero2")(Zero2)
REDUCERS.register("zero3")(Zero3)


def layout_key(name: str) -> str:
  """Reducers with the same key write the same checkpoint: the stateless
  ones ("plain"), else each its own (an unknown name: itself)."""
  if name not in REDUCERS:
    return name
  return getattr(REDUCERS.get(name), "checkpoint_layout", None) or name


config_lib.LAYOUT_KEYS["reducer"] = layout_key

__all__ = ["REDUCERS", "Replicated", "Sharded", "compressed", "layout_key"]
