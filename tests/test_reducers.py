"""Reducers (`--reducer`): a user's from outside the repo, and the old flags.

A module written to a temporary directory registers a reducer with an
option and a per-replica state of its own (a count of the steps it
reduced, with a Python `if` on a tensor: AutoGraph converts a user's
reducer), and a whole reducer class whose `apply` has such an `if`. Once
the module is loaded the option is a flag; both train through the entry
point on 2 replicas exactly as `--reducer=exact` (their arithmetic is the
exact sum), a rerun resumes its state from the checkpoint, and a
change of its layout option is refused. A workdir whose flags.txt was
written before `--reducer` (`--shard`, `--allreduce_compression` and every
compressor's option) resumes, and its layout is still checked.
"""

import io

import numpy as np
import pytest
import tensorflow as tf
from absl import flags

from conftest import run_main
from dist_loop import configure
from dist_loop.core.errors import UserError
from dist_loop.parallel import compression
from dist_loop.runtime.cluster import Cluster
from helpers import kept_registrations

MODULE = '''
"""A researcher's reducer, outside the repository."""
import dataclasses

import numpy as np
from dist_loop.core.options import option
from dist_loop.parallel import reducers
from dist_loop.parallel.compression import Compressor, nbytes
from dist_loop.parallel.compression.cast import Exact


@dataclasses.dataclass(frozen=True)
class Options:
  outside_scale: float = option(1.0, "Multiplies the sum.", above=0.0,
                                upper=4.0, layout=True)


@reducers.compressed("outside_sum")
class OutsideSum(Compressor):
  """The exact sum times --outside_scale; counts the steps it reduced."""

  Options = Options

  def initial_state(self):
    return {"count": [np.zeros((), np.float32)]}

  def reduce(self, grads, state, step):
    summed = [g * self.options.outside_scale for g in self.all_reduce(grads)]
    count = state["count"][0]
    if step >= 0:  # A tensor: AutoGraph makes this a tf.cond.
      count = count + 1.0
    return summed, {"count": [count]}

  def wire_bytes(self):
    return sum(nbytes(s, d) for s, d in zip(self.shapes, self.dtypes))


@reducers.REDUCERS.register("outside_guarded")
class OutsideGuarded(reducers.Replicated):
  """A whole reducer: the exact one, its update guarded by a Python `if`."""

  compressor_class = Exact

  def apply(self, grads, scale, step, exact):
    if step < 0:  # A tensor: AutoGraph makes this a tf.cond.
      grads = [g * 0.0 for g in grads]
    return reducers.Replicated.apply(self, grads, scale, step, exact)
'''
RUN = ["--dataset=synthetic", "--model=mlp", "--num_devices=2",
       "--train_steps=2", "--steps_per_loop=2", "--log_every=2",
       "--eval_every=2", "--checkpoint_every=2", "--global_batch_size=16"]


@pytest.fixture(name="registrations")
def _registrations():
  """What the module registers is undone after the test (a reducer
  registered with `compressed` is a compressor too)."""
  with kept_registrations(compression.COMPRESSORS):
    yield


def _counts(checkpoint):
  """Every replica's count, from the reducer's `compression` entry (an
  `.npz` of one [replicas] array: `replicas.ReplicaState`)."""
  [blob] = [v for k, v in checkpoint.items() if k.startswith("compression")]
  return list(np.load(io.BytesIO(blob.item() if hasattr(blob, "item")
                                 else blob))["arr_0"])


def _checkpoint(workdir):
  """{name: value} of a workdir's latest checkpoint."""
  reader = tf.train.load_checkpoint(str(workdir / "checkpoints"))
  return {k: reader.get_tensor(k)
          for k in reader.get_variable_to_shape_map()}


def test_a_reducer_from_outside_the_repo_has_its_flag_trains_and_resumes(
    tmp_path, registrations):
  del registrations
  module = tmp_path / "research" / "outside_sum.py"
  module.parent.mkdir()
  module.write_text(MODULE)
  mine, exact = tmp_path / "mine", tmp_path / "exact"
  code, _, err = run_main(f"--user_modules={module}", "--reducer=outside_sum",
                          f"--workdir={mine}", *RUN)
  assert code == 0, err
  assert "outside_scale" in flags.FLAGS
  flags_txt = (mine / "flags.txt").read_text()
  assert "--reducer=outside_sum\n" in flags_txt
  assert "--outside_scale=1.0\n" in flags_txt
  code, _, err = run_main("--reducer=exact", f"--workdir={exact}", *RUN)
  assert code == 0, err
  guarded = tmp_path / "guarded"
  code, _, err = run_main(f"--user_modules={module}",
                          "--reducer=outside_guarded", f"--workdir={guarded}",
                          *RUN)
  assert code == 0, err
  ours, theirs = _checkpoint(mine), _checkpoint(exact)
  assert _counts(ours) == [2.0, 2.0]  # One per replica.
  assert set(theirs) < set(ours)  # The exact run's, and the count.
  numeric = [k for k, v in theirs.items()
             if np.issubdtype(np.asarray(v).dtype, np.number)]
  assert len(numeric) > 4  # Weights, slots, step, ...
  for other in (ours, _checkpoint(guarded)):
    for name in numeric:
      np.testing.assert_allclose(other[name], theirs[name], atol=1e-6,
                                 err_msg=name)

  code, out, err = run_main(f"--flagfile={mine / 'flags.txt'}",
                            "--train_steps=4")
  assert code == 0, err
  assert "done: step 4" in out
  assert _counts(_checkpoint(mine)) == [4.0, 4.0]  # Restored, counted on.
  for args, named in (
      ([f"--flagfile={mine / 'flags.txt'}", "--outside_scale=2"],
       "--outside_scale: 1.0 -> 2.0"),
      ([f"--workdir={mine}", *RUN, "--reducer=exact"],
       "--reducer: outside_sum -> exact")):
    code, _, err = run_main(*args, "--train_steps=6")
    assert code != 0 and named in err, err


OLD = ("--shard=gradients\n--allreduce_bucket_mb=4.0\n"
       "--allreduce_compression=none\n--powersgd_rank=4\n"
       "--powersgd_start_step=0\n--topk_fraction=0.01\n")


def test_a_workdir_from_before_reducers_resumes_from_its_flags_txt(tmp_path):
  """Its flags.txt rewritten as the previous version wrote it."""
  workdir = tmp_path / "run"
  code, _, err = run_main("--reducer=zero2", f"--workdir={workdir}", *RUN)
  assert code == 0, err
  path = workdir / "flags.txt"
  options = "--allreduce_bucket_mb=4.0\n--zero_wire_dtype=float32\n"
  text = path.read_text()
  assert "--reducer=zero2\n" in text and options in text
  path.write_text(text.replace("--reducer=zero2\n", "").replace(options, OLD))
  code, _, err = run_main("--reducer=powersgd", f"--workdir={workdir}",
                          *RUN, "--train_steps=4")
  assert code != 0 and "--reducer: zero2 -> powersgd" in err, err
  code, out, err = run_main(f"--flagfile={path}", "--train_steps=4")
  assert code == 0, err
  assert "done: step 4" in out
  assert "--reducer=zero2\n" in path.read_text()  # Under the new names.


@pytest.mark.parametrize("old, new", [
    (dict(allreduce_compression="none"), dict(reducer="exact")),
    (dict(allreduce_compression="fp16", allreduce_bucket_mb=1.0),
     dict(reducer="cast", cast_dtype="fp16", allreduce_bucket_mb=1.0)),
    (dict(allreduce_compression="powersgd", powersgd_rank=2,
          allreduce_bucket_mb=4.0, topk_fraction=0.01),
     dict(reducer="powersgd", powersgd_rank=2)),
    (dict(allreduce_compression="topk", topk_fraction=0.1),
     dict(reducer="topk", topk_fraction=0.1)),
    (dict(shard="optimizer"), dict(reducer="zero1")),
    (dict(shard="weights", allreduce_compression="bf16", powersgd_rank=4),
     dict(reducer="zero3", zero_wire_dtype="bf16")),
], ids=["none", "fp16", "powersgd", "topk", "optimizer", "weights_bf16"])
def test_the_old_flags_make_the_config_of_the_new(old, new):
  """The old selectors (and the other compressors' options at their
  defaults, as an old flags.txt holds them) are the reducer's flags."""
  assert configure.make_config(workdir="w", **old) == configure.make_config(
      workdir="w", **new)


@pytest.mark.parametrize("flat", [dict(reducer="cast"),
                                  dict(allreduce_bucket_mb=1.0),
                                  dict(shard="optimizer")],
                         ids=["reducer", "option", "old_flag"])
def test_a_mode_without_a_reducer_refuses_one(flat):
  with pytest.raises(UserError, match="^--mode=async does not use a reducer; "
                     "drop --reducer and its options"):
    configure.validate(configure.make_config(
        workdir="w", mode="async", dataset="synthetic", model="mlp", **flat),
                       Cluster())
