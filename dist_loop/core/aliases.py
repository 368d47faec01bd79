"""Flags renamed, still accepted under their old names for one release.

Before `--reducer`, sync mode chose its reduction with two flags,
`--allreduce_compression=none|fp16|bf16|powersgd|topk|NAME` and
`--shard=none|optimizer|gradients|weights`, and a workdir's flags.txt
held every compressor's option, at its default where it did not apply.
`translate` turns such settings (a command line, or an old flags.txt) into
the reducer's, so old commands run and old workdirs resume: an old option
that the chosen reducer does not own is dropped at its old default, and
refused otherwise (as it was). Pure: names and values only.
"""

from typing import Any, Dict

from dist_loop.core.errors import UserError

OLD_SELECTORS = ("allreduce_compression", "shard")
_STAGES = {"none": None, "optimizer": "zero1", "gradients": "zero2",
           "weights": "zero3"}
_CASTS = ("fp16", "bf16")
# Sync's old options: (their default, the reducers that own them now).
_OLD_OPTIONS = {
    "allreduce_bucket_mb": (4.0, ("exact", "cast", "zero1", "zero2",
                                  "zero3")),
    "powersgd_rank": (4, ("powersgd",)),
    "powersgd_start_step": (0, ("powersgd",)),
    "topk_fraction": (0.01, ("topk",)),
}


def translate(fields: Dict[str, Any]) -> Dict[str, Any]:
  """`fields` (flag name -> value, typed or as text) with the old
  selectors replaced by `reducer` and its options.

  Raises:
    UserError: the old flags name a combination that never worked, or
      `--reducer` is given too and disagrees.
  """
  if not any(fields.get(k) is not None for k in OLD_SELECTORS):
    return {k: v for k, v in fields.items() if k not in OLD_SELECTORS}
  out = {k: v for k, v in fields.items() if k not in OLD_SELECTORS}
  compression = str(fields.get("allreduce_compression") or "none")
  shard = str(fields.get("shard") or "none")
  if shard not in _STAGES:
    raise UserError(f"unknown --shard={shard!r}; choose one of: "
                    f"{', '.join(_STAGES)} (or use --reducer)")
  if _STAGES[shard]:
    if compression not in ("none",) + _CASTS:
      raise UserError(
          f"--shard={shard} cannot be combined with --allreduce_compression="
          f"{compression}: its reduction is not a sum that can be cut into "
          "shards; use none, fp16 or bf16, or --shard=none")
    reducer = _STAGES[shard]
    out["zero_wire_dtype"] = "float32" if compression == "none" else compression
  elif compression == "none":
    reducer = "exact"
  elif compression in _CASTS:
    reducer = "cast"
    out["cast_dtype"] = compression
  else:
    reducer = compression
  given = fields.get("reducer")
  if given is not None and str(given) not in ("exact", reducer):
    raise UserError(
        f"--reducer={given} and --allreduce_compression={compression} "
        f"--shard={shard} disagree; the latter are the old names of "
        f"--reducer={reducer}: use --reducer only")
  out["reducer"] = reducer
  for name, (default, owners) in _OLD_OPTIONS.items():
    if name in out and reducer not in owners and _equal(out[name], default):
      del out[name]
  return out


def _equal(value: Any, default: Any) -> bool:
  try:
    return float(value) == float(default)
  except (TypeError, ValueError):
    return False
