"""The command-line contract: flag definitions, parse-time checks, Config.

Every flag here maps one to one onto a `dist_loop.Config` field. Checks that a
flag can do alone (enums, bounds, registered names) and those that span flags
run while absl parses, so a bad command fails before TensorFlow starts any
work. `to_config()` is the only bridge from FLAGS to the library.
"""

import dataclasses

from absl import flags

from dist_loop import config as config_lib
from dist_loop import data, models, modes, optim
from dist_loop.modes.asynchronous import policies as async_policies
from dist_loop.errors import UserError

FLAGS = flags.FLAGS

# -- run --
flags.DEFINE_string("workdir", None, "Directory of the run: checkpoints, "
                    "TensorBoard events, flags.txt, summary.json. Rerunning "
                    "on the same workdir resumes.")
flags.DEFINE_enum("mode", "sync", modes.MODES.names(), "Parallel mode.")
flags.DEFINE_integer("train_steps", 1000, "Steps to train (applied updates).",
                     lower_bound=1)
flags.DEFINE_integer("seed", 0, "Seed of initialisation and data order.")
flags.DEFINE_bool("deterministic", False, "Deterministic kernels "
                  "(tf.config.experimental.enable_op_determinism).")
# -- data and model --
flags.DEFINE_string("dataset", "digits", "Registered dataset: "
                    + ", ".join(data.DATASETS.names()) + ".")
flags.DEFINE_string("data_dir", None, "Where file-based datasets (mnist.npz) "
                    "are read from; default: the Keras cache.")
flags.DEFINE_string("model", "cnn", "Registered model: "
                    + ", ".join(models.MODELS.names()) + ".")
flags.DEFINE_integer("global_batch_size", 64, "Examples per step over all "
                     "replicas.", lower_bound=1)
flags.DEFINE_integer("eval_batch_size", 256, "Batch size of evaluation.",
                     lower_bound=1)
# -- optimizer --
flags.DEFINE_string("optimizer", "adam", "Registered optimizer: "
                    + ", ".join(optim.OPTIMIZERS.names()) + ".")
flags.DEFINE_float("learning_rate", 1e-3, "Learning rate.", lower_bound=0.0)
# -- devices --
flags.DEFINE_integer("num_devices", 1, "Devices: logical CPU devices on a "
                     "CPU-only machine, else the first N GPUs.", lower_bound=1)
flags.DEFINE_enum("device_type", "auto", config_lib.DEVICE_TYPES,
                  "auto: GPUs if present, else CPU.")
flags.DEFINE_integer("intra_op_threads", 0, "Threads inside one op "
                     "(0: TensorFlow's default).", lower_bound=0)
flags.DEFINE_integer("inter_op_threads", 0, "Ops run concurrently "
                     "(0: TensorFlow's default).", lower_bound=0)
# -- the loop --
flags.DEFINE_integer("steps_per_loop", 10, "Steps per tf.function call.",
                     lower_bound=1)
flags.DEFINE_integer("log_every", 50, "Steps between progress lines and "
                     "train summaries.", lower_bound=1)
flags.DEFINE_integer("eval_every", 200, "Steps between evaluations.",
                     lower_bound=1)
flags.DEFINE_integer("checkpoint_every", 200, "Steps between checkpoints.",
                     lower_bound=1)
flags.DEFINE_integer("max_checkpoints", 3, "Checkpoints kept.", lower_bound=1)
flags.DEFINE_integer("histogram_every", 0, "Steps between weight and "
                     "gradient histograms (0: never).", lower_bound=0)
flags.DEFINE_string("profile_steps", "", "FIRST,LAST: write a TF profiler "
                    "trace of these steps to TensorBoard's Profile tab.")
# -- precision and accumulation --
flags.DEFINE_enum("precision", "float32", config_lib.PRECISIONS,
                  "Compute dtype policy; master weights stay float32. "
                  "mixed_float16 adds dynamic loss scaling.")
flags.DEFINE_integer("grad_accum_steps", 1, "Micro-steps of "
                     "--global_batch_size examples each, summed before one "
                     "all-reduce and one update (sync mode).", lower_bound=1)
# -- reliability --
flags.DEFINE_enum("nonfinite", "raise", config_lib.NONFINITE_POLICIES,
                  "On a NaN/Inf loss or gradient: raise (stop, naming the "
                  "step), skip (drop that update on every replica), or "
                  "rollback (restore the last checkpoint).")
flags.DEFINE_integer("max_rollbacks", 3, "With --nonfinite=rollback: give up "
                     "after this many.", lower_bound=0)
flags.DEFINE_float("grace_period_s", 30.0, "After SIGTERM, seconds to save a "
                   "checkpoint and exit.", lower_bound=0.1)
flags.DEFINE_bool("allow_config_change", False, "Resume a workdir even if "
                  "the model or device layout flags differ from flags.txt.")
# -- all-reduce --
flags.DEFINE_integer("allreduce_bytes_per_pack", 0, "Pack gradients into "
                     "chunks of this many bytes for the all-reduce (0: "
                     "TensorFlow decides).", lower_bound=0)
flags.DEFINE_enum("allreduce_compression", "none", config_lib.COMPRESSIONS,
                  "Cast gradients to this dtype for the all-reduce.")
# -- pipeline --
flags.DEFINE_integer("num_stages", 2, "Pipeline stages K (--mode=pipeline); "
                     "--num_devices=R*K runs R data-parallel pipelines.",
                     lower_bound=1)
flags.DEFINE_enum("stage_split", "auto", ["auto", "params", "explicit"],
                  "How the layers are cut into stages: auto (the model's own "
                  "split if it declares one, else balance measured time), "
                  "params (balance parameter counts), explicit "
                  "(--split_points).")
flags.DEFINE_string("split_points", "", "For --stage_split=explicit: K-1 "
                    "increasing layer indices where stages start, e.g. 2,4.")
flags.DEFINE_integer("num_microbatches", 4, "Micro-batches M per replica "
                     "batch; use M >= 4K for a small bubble.", lower_bound=1)
flags.DEFINE_string("pipeline_schedule", "1f1b", "Registered pipeline "
                    "schedule: gpipe, 1f1b, or one an extension adds.")
flags.DEFINE_enum("recompute", "never", ["never", "always", "except_last"],
                  "Recompute each stage's activations in its backward "
                  "(tf.recompute_grad) instead of keeping them.")
# -- async --
flags.DEFINE_integer("async_workers", 0, "Worker threads of --mode=async, "
                     "each on its own device (round robin) with its own "
                     "model copy and input shard (0: one per device).",
                     lower_bound=0)
flags.DEFINE_integer("max_staleness", -1, "Async and ps: drop gradients more "
                     "than this many updates stale (-1: no bound).",
                     lower_bound=-1)
flags.DEFINE_string("staleness_lr", "none", "Async: registered staleness "
                    "learning-rate policy: none, inverse (lr / max(1, tau)), "
                    "or one an extension adds.")
flags.DEFINE_string("async_compensation", "none", "Async: registered delay "
                    "compensation: none, dc (DC-ASGD).")
flags.DEFINE_float("dc_lambda", 0.04, "Async: DC-ASGD strength lambda in "
                   "g + lambda*g*g*(w_now - w_read).", lower_bound=0.0)
flags.DEFINE_string("straggler", None, "WORKER:FACTOR makes one worker (async) "
                    "or replica (sync) FACTOR times slower, e.g. 1:3; for "
                    "research and benchmarks.")
# -- multiple processes (TF_CONFIG; see tools/launch.py) --
flags.DEFINE_float("collective_timeout_s", 120.0, "Multi-worker sync: a "
                   "collective that waits this long for a peer fails "
                   "(CommunicationOptions.timeout_seconds); ps: training "
                   "fails after this long without an applied update.",
                   lower_bound=0.001)
flags.DEFINE_integer("ps_steps_per_call", 4, "Ps: steps one scheduled "
                     "function runs on a worker per call.", lower_bound=1)


def _registered(registry):
  def check(name):
    if name not in registry:
      raise flags.ValidationError(
          f"unknown {registry.kind} {name!r}; registered: "
          f"{', '.join(registry.names())}")
    return True
  return check


flags.register_validator("dataset", _registered(data.DATASETS))
flags.register_validator("model", _registered(models.MODELS))
flags.register_validator("optimizer", _registered(optim.OPTIMIZERS))
flags.register_validator("staleness_lr",
                         _registered(async_policies.STALENESS_LR))
flags.register_validator("async_compensation",
                         _registered(async_policies.COMPENSATIONS))


def _field_names():
  return [f.name for f in dataclasses.fields(config_lib.Config)]


@flags.multi_flags_validator(["mode", "num_devices", "global_batch_size"])
def _config_is_valid(values):
  """Every rule that spans flags, mode-specific ones included, at parse time.

  The rules live with the code they protect (`Config.validate` and each
  mode's `Trainer.validate_config`); this only runs them. absl runs
  validators once all flags are parsed, so the other fields are read as-is.
  """
  fields = {n: FLAGS[n].value for n in _field_names()}
  fields.update(values)
  try:
    config_lib.Config(**fields).validate()
  except UserError as e:
    raise flags.ValidationError(str(e)) from None
  return True


def to_config() -> config_lib.Config:
  """The parsed flags as a frozen Config (raises UserError if invalid)."""
  return config_lib.Config(**{n: FLAGS[n].value for n in _field_names()}
                           ).validate()


def to_flagfile() -> str:
  """The resolved run flags in flagfile format, for WORKDIR/flags.txt."""
  lines = [FLAGS[n].serialize() for n in _field_names()]
  return "\n".join(line for line in lines if line) + "\n"
