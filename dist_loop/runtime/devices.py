"""Choosing the devices a run trains on.

On a CPU-only machine, `--num_devices=N` splits the one physical CPU into N
logical devices, so every parallel mode runs (and is tested) without GPUs. On a
GPU machine the first N GPUs are used. TensorFlow fixes the device list and the
thread pools when its runtime starts, so `configure` must run before any op;
a second call in the same process can only reuse what the first one set up.
A multi-worker run starts the runtime earlier, when it joins the cluster, so
the join calls `set_threads` first; `configure` then finds them set.
"""

import os
from typing import List, Mapping

import tensorflow as tf

from dist_loop.core.config import MAX_THREADS
from dist_loop.core.errors import UserError

# TensorFlow's own thread-count variables, read when its runtime starts,
# and the flag each stands beside. A value it cannot take (-3) aborts the
# process in native code, so they are checked with the flags.
THREAD_VARIABLES = (("TF_NUM_INTRAOP_THREADS", "intra_op_threads"),
                    ("TF_NUM_INTEROP_THREADS", "inter_op_threads"))


def check_thread_variables(environ: Mapping[str, str]) -> None:
  """Refuses a thread-count variable that is not a count the flag beside it
  takes (0 to MAX_THREADS; 0 or unset: TensorFlow's default).

  Raises:
    UserError: naming the variable and the flag.
  """
  for name, flag in THREAD_VARIABLES:
    value = environ.get(name)
    if value is None or value.strip() == "":
      continue
    text = value.strip()
    if not (text.isdigit() and int(text) <= MAX_THREADS):
      raise UserError(f"{name}={value!r} in the environment is not a thread "
                      f"count from 0 to {MAX_THREADS} (TensorFlow reads it "
                      f"at start); unset it, or use --{flag}=N")


def max_logical_cpus() -> int:
  """More logical CPU devices than this only adds thread contention."""
  return max(8, 4 * (os.cpu_count() or 1))


def resolve_device_type(device_type: str) -> str:
  if device_type == "auto":
    return "gpu" if tf.config.list_physical_devices("GPU") else "cpu"
  return device_type


def configure(num_devices: int, device_type: str = "auto",
              intra_op_threads: int = 0,
              inter_op_threads: int = 0) -> List[str]:
  """Makes `num_devices` devices of `device_type` available; returns names.

  Args:
    num_devices: how many devices (replicas, stages or workers) the run uses.
    device_type: "auto" (GPUs if any, else CPU), "cpu" or "gpu".
    intra_op_threads: threads inside one op; 0 leaves TensorFlow's default.
    inter_op_threads: ops run concurrently; 0 leaves TensorFlow's default.

  Returns:
    Device names such as "/device:CPU:1", one per device, in order.

  Raises:
    UserError: the devices are not there, or the process already started
      TensorFlow with fewer logical devices.
  """
  kind = resolve_device_type(device_type)
  if kind == "gpu":
    gpus = tf.config.list_physical_devices("GPU")
    if num_devices > len(gpus):
      raise UserError(
          f"--num_devices={num_devices} but this machine has {len(gpus)} "
          f"GPU(s); lower --num_devices or use --device_type=cpu")
    set_threads(intra_op_threads, inter_op_threads)
    logical = tf.config.list_logical_devices("GPU")
    return [d.name for d in logical[:num_devices]]

  limit = max_logical_cpus()
  if num_devices > limit:
    raise UserError(
        f"--num_devices={num_devices} is more logical CPU devices than this "
        f"machine can usefully run ({limit} for {os.cpu_count()} cores); "
        f"use --num_devices={limit} or fewer")
  cpu = tf.config.list_physical_devices("CPU")[0]
  try:
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * num_devices)
  except RuntimeError:
    pass  # Already initialized: reuse the devices if there are enough.
  set_threads(intra_op_threads, inter_op_threads)
  logical = tf.config.list_logical_devices("CPU")
  if len(logical) < num_devices:
    raise UserError(
        f"--num_devices={num_devices} but TensorFlow already started in this "
        f"process with {len(logical)} logical CPU device(s); run in a new "
        "process")
  return [d.name for d in logical[:num_devices]]


def set_threads(intra: int, inter: int) -> None:
  """Sizes the thread pools: `intra` threads inside one op, `inter` ops at
  once; 0 leaves TensorFlow's default. A pool already of that size is left
  as it is, so a second call with the same counts is a no-op.

  Raises:
    UserError: TensorFlow started with other counts.
  """
  for value, getter, setter in (
      (intra, tf.config.threading.get_intra_op_parallelism_threads,
       tf.config.threading.set_intra_op_parallelism_threads),
      (inter, tf.config.threading.get_inter_op_parallelism_threads,
       tf.config.threading.set_inter_op_parallelism_threads)):
    if value and getter() != value:
      try:
        setter(value)
      except RuntimeError as e:
        raise UserError(
            "thread counts must be set before TensorFlow starts; run in a new "
            f"process ({e})") from None
