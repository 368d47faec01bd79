"""The async mode with its threads: equivalence, faults, runs, validation."""

import json
import os
import queue
import threading
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import read_events
from helpers import load_data
from dist_loop import train
from dist_loop import UserError, configure, models
from dist_loop.control import weights
from dist_loop.control.evaluation import Evaluator
from dist_loop.core.errors import Interrupted
from dist_loop.data import train_dataset_fn
from dist_loop.parallel.modes import build_trainer
from dist_loop.parallel.modes.asynchronous import threads
from dist_loop.parallel.modes.asynchronous.session import Session
from dist_loop.parallel.modes.asynchronous.threads import WorkerFailed
from dist_loop.runtime import checkpoints, devices
from dist_loop.runtime.cluster import Cluster
from dist_loop.runtime.summaries import LOGDIR


def async_threads():
  return [t.name for t in threading.enumerate()
          if t.name.startswith("async-") and t.is_alive()]


def build(config):
  config = configure.validate(config, Cluster())
  split = load_data(config)
  names = devices.configure(config.num_devices, "cpu")
  keras.utils.set_random_seed(config.seed)
  return build_trainer(config, names, split, Cluster()), split


def test_a_stop_ends_every_wait_within_a_poll():
  crew = threads.Crew()
  full = queue.Queue(maxsize=1)
  full.put(0)
  waits = [lambda: crew.get(queue.Queue()), lambda: crew.put(full, 1),
           lambda: crew.wait(threading.Event())]
  ended = []

  def blocked(wait):
    try:
      wait()
    except threads.Stopped:
      ended.append(time.monotonic())

  for i, wait in enumerate(waits):
    crew.start(f"async-test-{i}", f"test {i}", blocked, wait)
  time.sleep(3 * threads.POLL_SECONDS)
  assert not ended  # Each is still waiting.
  stopped_at = time.monotonic()
  assert crew.close() == []
  assert len(ended) == 3
  assert max(ended) - stopped_at < 2.0  # A poll is 0.05 s; no hang.
  crew.check()  # Stopping is not a failure.


def test_one_worker_is_sequential_sgd(small_config):
  config = small_config(mode="async", async_workers=1, optimizer="sgd",
                        learning_rate=0.1)
  trainer, split = build(config)
  reference = models.build(config.model, split.input_shape, split.num_classes)
  reference.set_weights(trainer.model.get_weights())
  batches = iter(train_dataset_fn(split.train_x, split.train_y,
                                  config.global_batch_size, config.seed)(
                                      tf.distribute.InputContext()))
  try:
    for step, chunk in enumerate([1, 1, 1, 3, 2], start=1):
      trainer.train(chunk)
      for _ in range(chunk):  # Plain SGD, one batch after the other.
        x, y = next(batches)
        with tf.GradientTape() as tape:
          loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
              y, reference(x), from_logits=True))
        grads = tape.gradient(loss, reference.trainable_variables)
        for var, grad in zip(reference.trainable_variables, grads):
          var.assign_sub(config.learning_rate * grad)
      diff = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in
                 zip(trainer.model.trainable_variables,
                     reference.trainable_variables))
      assert diff <= 1e-5, f"after train call {step}: {diff}"
    assert int(trainer.step.numpy()) == 8
    assert trainer.applier.staleness.by_tau() == {0: 8}
  finally:
    trainer.close()
  assert not async_threads()


def test_zero_staleness_bound_still_makes_progress(small_config):
  # Each worker has one push in flight and re-reads the master once it is
  # dealt with, so after a drop it computes on the newest version: at least
  # one of every W pushes is fresh.
  config = small_config(mode="async", num_devices=2, max_staleness=0)
  trainer, _ = build(config)
  try:
    trainer.train(12)
  finally:
    trainer.close()
  assert int(trainer.step.numpy()) == 12
  assert trainer.applier.staleness.by_tau() == {0: 12}


@pytest.mark.parametrize("where", ["worker", "applier"])
def test_a_failing_thread_stops_training_quickly(small_config, where):
  config = small_config(mode="async", num_devices=2, train_steps=10**6)
  trainer, _ = build(config)
  calls = {"n": 0}

  def boom(*args):
    calls["n"] += 1
    if calls["n"] == 3:
      calls["failed_at"] = time.monotonic()
      raise ValueError("boom")
    return original(*args)

  if where == "worker":
    original = trainer.workers[1].compute
    trainer.workers[1].compute = boom
    name = "async worker 1 on /device:CPU:1"
  else:
    original = trainer.applier.offer
    trainer.applier.offer = boom
    name = "async applier"
  with pytest.raises(WorkerFailed, match=f"{name} failed: ValueError: boom"):
    trainer.train(10**6)
  # Measured from the failure, not from the start: tracing is not the point.
  assert time.monotonic() - calls["failed_at"] < 10
  assert not async_threads()
  trainer.close()  # A second close is harmless.


def test_ctrl_c_saves_a_checkpoint_and_stops_the_threads(small_config,
                                                         monkeypatch):
  config = small_config(mode="async", num_devices=2, train_steps=40)
  run = Session.run
  calls = {"n": 0}

  def interrupt_third_loop(self, budget):
    calls["n"] += 1
    if calls["n"] == 3:
      raise KeyboardInterrupt()
    return run(self, budget)

  monkeypatch.setattr(Session, "run", interrupt_third_loop)
  with pytest.raises(Interrupted) as info:
    train.run(config)
  assert not async_threads()
  saved = tf.train.latest_checkpoint(os.path.join(config.workdir,
                                                  "checkpoints"))
  assert saved.endswith(f"-{info.value.step}")


def test_run_logs_staleness_and_resumes_in_sync_mode(small_config):
  config = small_config(mode="async", num_devices=3, async_workers=3,
                        train_steps=20, max_staleness=2,
                        staleness_lr="inverse", async_compensation="dc",
                        straggler="2:2")
  summary = train.run(config)
  assert not async_threads()
  assert summary["final_step"] == 20
  assert summary["async_applied"] == 20
  assert summary["async_workers"] == 3
  assert summary["async_skipped_pushes"] == 0
  assert summary["async_staleness_max"] <= 2
  assert sum(summary["async_staleness_counts"].values()) == 20
  assert "async_updates_per_sec" not in summary
  with open(os.path.join(config.workdir, "summary.json")) as f:
    assert json.load(f)["async_dropped"] == summary["async_dropped"]

  tags = set(read_events(os.path.join(config.workdir, LOGDIR)))
  for tag in ("train/async/staleness", "train/async/staleness_mean",
              "train/async/dropped", "train/async/skipped_pushes",
              "train/async/worker2_steps_per_sec", "train/loss",
              "eval/accuracy"):
    assert tag in tags
  assert not tags & {"train/async/updates_per_sec", "train/async/skipped"}

  # Checkpoints are interchangeable: sync resumes the async run.
  sync = small_config(mode="sync", num_devices=2, straggler="1:2",
                      train_steps=25, allow_config_change=True)
  resumed = train.run(sync)
  assert resumed["final_step"] == 25
  # The checkpoint holds the master that the run evaluated last.
  model = weights.load_model(sync)
  evaluator = Evaluator(model, load_data(sync), 256)  # Traced once.
  loaded = evaluator.evaluate()
  assert loaded["eval/loss"] == pytest.approx(resumed["eval_loss"], abs=1e-6)
  model.set_weights(weights.load_model(
      config, os.path.join(config.workdir, "checkpoints", "ckpt-20")
  ).get_weights())
  at_20 = evaluator.evaluate()
  assert at_20["eval/loss"] == pytest.approx(summary["eval_loss"], abs=1e-6)
  assert at_20["eval/loss"] != loaded["eval/loss"]  # Sync trained on.


@pytest.mark.parametrize("overrides,message", [
    (dict(straggler="2"), "must be WORKER:FACTOR"),
    (dict(straggler="1:0.5"), "must be WORKER:FACTOR"),
    (dict(straggler="4:3"), "use --straggler=3:3"),
    (dict(straggler="2:3", async_workers=2), "use --straggler=1:3"),
    (dict(max_staleness=-2), "--max_staleness must be >= -1"),
    (dict(staleness_lr="no_such_rule"),
     "unknown --staleness_lr='no_such_rule'; choose one of: .*inverse"),
    (dict(async_compensation="x"), "choose one of: dc, none"),
    (dict(async_workers=-1), "--async_workers must be >= 0"),
    (dict(nonfinite="skip"), "use --nonfinite=rollback or raise"),
    (dict(grad_accum_steps=2), "--grad_accum_steps is not supported"),
])
def test_bad_async_flags_fail_at_the_door(small_config, overrides, message):
  with pytest.raises(UserError, match=message):
    configure.validate(small_config(mode="async", num_devices=4, **overrides),
                       Cluster())


def test_straggler_is_checked_in_sync_mode_too(small_config):
  configure.validate(small_config(mode="sync", num_devices=2,
                                  straggler="1:10"), Cluster())
  with pytest.raises(UserError, match="2 replicas .* use --straggler=1:10"):
    configure.validate(small_config(mode="sync", num_devices=2,
                                    straggler="2:10"), Cluster())


# -- float16 loss scaling --


def test_fp16_trains_and_resumes_its_loss_scale(small_config):
  config = small_config(mode="async", num_devices=2, precision="mixed_float16",
                        train_steps=4, steps_per_loop=2, log_every=2,
                        eval_every=4, checkpoint_every=2)
  trainer, _ = build(config)
  assert trainer.checkpoint_items()["loss_scale"] is trainer.loss_scale
  trainer.loss_scale.scale.assign(2.0 ** 7)  # Not the initial scale.
  checkpoints.manager(trainer.checkpoint_items(), config.workdir,
                      max_to_keep=3).save(checkpoint_number=0)
  trainer.close()
  summary = train.run(config)
  assert not async_threads()
  assert summary["final_step"] == 4 and summary["async_applied"] == 4
  assert summary["async_skipped_pushes"] == summary["skipped_steps"] == 0
  saved = tf.train.load_checkpoint(os.path.join(config.workdir, "checkpoints"))
  assert saved.get_tensor("loss_scale/scale/.ATTRIBUTES/VARIABLE_VALUE") == (
      2.0 ** 7)
  assert saved.get_tensor("step/.ATTRIBUTES/VARIABLE_VALUE") == 4
