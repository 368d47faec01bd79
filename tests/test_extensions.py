"""The worked examples of experiments/extensions: each plugs in by
registration alone (imported here; a run loads them with --user_modules),
and behaves as its docstring says."""

import collections

import pytest
from absl import flags
from absl.testing import flagsaver

from conftest import max_diff
from dist_loop import configure, make_config
from dist_loop.models import MODELS
from dist_loop.parallel.modes import MODES, build_trainer, xla
from dist_loop.parallel.modes.asynchronous import policies
from dist_loop.parallel.modes.pipeline import schedule as schedule_lib
from dist_loop.runtime import devices
from dist_loop.runtime.cluster import Cluster
from experiments import flags as run_flags
from experiments.extensions import eager_1f1b, exp_staleness, residual_cnn
from experiments.extensions import single_device
from helpers import initial_and_trained, load_data, make_trainer


def test_each_extension_is_registered_under_its_flag_value():
  assert MODELS.get("residual_cnn") is residual_cnn.residual_cnn
  assert policies.STALENESS_LR.get("exp") is exp_staleness.exponential
  assert schedule_lib.SCHEDULES.get("eager_1f1b") is eager_1f1b.eager_1f1b
  assert MODES.get("single_device") is single_device.SingleDeviceTrainer


def test_exponential_staleness_halves_per_version():
  assert [exp_staleness.exponential(t) for t in range(4)] == [
      1.0, 0.5, 0.25, 0.125]


def test_eager_1f1b_order_and_memory():
  sched = schedule_lib.make("eager_1f1b", 2, 4)
  assert [" ".join(map(str, s)) for s in sched] == [
      "F0 F1 F2 B0 F3 B1 B2 B3",  # One forward more than 1F1B's warm-up.
      "F0 B0 F1 B1 F2 B2 F3 B3",
  ]
  # M=3 (the residual CNN's run below) still differs from 1F1B's order.
  orders = [[" ".join(map(str, s)) for s in schedule_lib.make(name, 2, 3)]
            for name in ("eager_1f1b", "1f1b")]
  assert orders[0][0] == "F0 F1 F2 B0 B1 B2" != orders[1][0]
  for k_stages, m in ((2, 4), (3, 6), (4, 8), (4, 2)):
    sched = schedule_lib.make("eager_1f1b", k_stages, m)  # Validates it.
    for k, actions in enumerate(sched):
      assert schedule_lib.peak_activations(actions) <= min(
          k_stages - k + 1, m)


def test_residual_cnn_in_two_stages_with_eager_1f1b_equals_sync(
    small_config, tmp_path, monkeypatch, eager_costs):
  # Two stages cut between the pool and the third block: each stage holds
  # residual blocks, and at K=2, M=3 eager 1F1B's order differs from 1F1B's
  # (F0 F1 F2 B0 B1 B2 on stage 0, not F0 F1 B0 F2 B1 B2; M=2 would not
  # differ; test_eager_1f1b_order_and_memory checks M=4 and validates K=4
  # too). Four stages
  # (residual_cnn_pipeline.flags, whose trainer test_entry_point.py builds)
  # would double the traced step for no path that two do not run. The
  # digits at their own 8x8 (every layer still runs: the pool leaves 4x4),
  # and the plan from eager layer costs: planning is not the point here
  # (eager_1f1b.flags plans from traced costs end to end in
  # test_entry_point.py).
  monkeypatch.setattr(residual_cnn.residual_cnn, "image_size", None)
  common = dict(dataset="digits", model="residual_cnn", optimizer="adam",
                learning_rate=0.003, global_batch_size=12)
  start, sync = initial_and_trained(
      small_config(workdir=str(tmp_path / "sync"), **common), 3)
  _, piped = initial_and_trained(small_config(
      workdir=str(tmp_path / "pipe"), mode="pipeline", num_devices=2,
      num_stages=2, stage_split="explicit", split_points="4",
      num_microbatches=3, pipeline_schedule="eager_1f1b",
      pipeline_timing="never", **common), 3)
  assert max_diff(sync, piped) <= 1e-5
  assert max_diff(sync, start) > 1e-3


def test_async_consults_the_exponential_policy_once_per_applied_update(
    small_config, monkeypatch):
  taus = []

  def spy(tau):
    taus.append(tau)
    return exp_staleness.exponential(tau)

  monkeypatch.setitem(policies.STALENESS_LR._entries, "exp", spy)  # pylint: disable=protected-access
  # The trainer alone: the policy is the applier's, not the controller's.
  trainer = make_trainer(small_config(mode="async", num_devices=2,
                                      async_workers=2, staleness_lr="exp",
                                      max_staleness=4, train_steps=20))
  try:
    trainer.train(20)
    assert int(trainer.step.numpy()) == 20
    summary = trainer.summary()
  finally:
    trainer.close()
  # Every applied update asked the policy, with the staleness it was
  # applied at (calls come in order; a push still in flight at the end may
  # ask after the summary was read).
  applied = summary["async_applied"]
  assert applied >= 20 and len(taus) >= applied
  counts = collections.Counter(taus[:applied])
  assert {str(t): c for t, c in counts.items()} == summary[
      "async_staleness_counts"]


# -- single_device: a mode with its own flag --

def _parse(*argv):
  """The entry point's real flag parsing, in this process.

  The entry point imports the modules of `--user_modules` before it
  defines the flags (tests/test_entry_point.py runs single_device.flags
  through it); here the flags were made before this file imported the
  extensions, so their flags are defined now, as the entry point's
  `load_user_code` does.
  """
  run_flags.define_component_flags()
  flags.FLAGS(["train", "--workdir=/tmp/unused", *argv])
  return run_flags.to_config()


def test_single_device_jit_compile_is_the_run_wide_flag():
  """Its old `--jit_compile` (once its own option) keeps working: it is
  the run-wide flag now, which every mode reads."""
  with flagsaver.flagsaver():
    config = _parse("--mode=single_device", "--jit_compile")
    assert config.jit_compile is True
    assert "--jit_compile\n" in run_flags.to_flagfile()
  with flagsaver.flagsaver():  # Decided as its trainer is built.
    assert _parse("--mode=single_device").jit_compile == "auto"
  with flagsaver.flagsaver():
    assert _parse("--mode=sync", "--jit_compile").jit_compile is True
  assert make_config(workdir="w", mode="single_device",
                     jit_compile=True).jit_compile is True


def test_single_device_follows_the_auto_rule_of_every_mode(small_config):
  """On CPU its update is not compiled; on (faked) GPUs it would be."""
  config = configure.validate(small_config(mode="single_device"), Cluster())
  dataset = load_data(config)
  gpu = ["/job:localhost/replica:0/task:0/device:GPU:0"]
  assert xla.resolve(config, gpu, dataset, Cluster())[0].jit_compile is True
  trainer = build_trainer(config, devices.configure(1, "cpu"), dataset,
                          Cluster())
  try:
    assert trainer.config.jit_compile is False
    assert trainer.xla_choice.startswith("XLA: off (--jit_compile=auto on "
                                         "CPU")
  finally:
    trainer.close()


def test_single_device_refuses_several_devices():
  with flagsaver.flagsaver():
    with pytest.raises(flags.IllegalFlagValueError,
                       match="use --num_devices=1, or --mode=sync"):
      _parse("--mode=single_device", "--num_devices=2")


def test_single_device_equals_sync_on_one_device(small_config, tmp_path):
  common = dict(optimizer="adam", learning_rate=0.01)
  start, sync = initial_and_trained(
      small_config(workdir=str(tmp_path / "sync"), **common), 4)
  assert max_diff(sync, start) > 1e-3
  for jit in (False, True):
    _, single = initial_and_trained(small_config(
        workdir=str(tmp_path / f"single_{jit}"), mode="single_device",
        jit_compile=jit, **common), 4)
    assert max_diff(sync, single) <= 1e-5, jit
