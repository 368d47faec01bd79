"""The async applier, its policies and its float16 overflow rule, driven
without threads.

A harness forces a known interleaving (at every tick, worker k = tick mod W
pushes a gradient computed on master version t - k) on a linear softmax
model, whose gradient numpy computes exactly. The expected trajectory,
staleness counts and drops come from a plain numpy re-implementation of the
rules, so the test checks the applier against the paper formulas, not
against itself.
"""

import collections

import keras
import numpy as np
import pytest
import tensorflow as tf

from helpers import load_data
from dist_loop import UserError, configure, data, models, tasks
from dist_loop.parallel.modes import build_trainer
from dist_loop.parallel.modes.asynchronous import policies
from dist_loop.parallel.modes.asynchronous.applier import Applier
from dist_loop.parallel.modes.asynchronous.worker import Push, Worker
from dist_loop.runtime import devices
from dist_loop.runtime.cluster import Cluster
from dist_loop.training import optim

LINEAR = "linear_async_test"
NUM_WORKERS = 4
BATCH = 16
LR = 0.5


@models.MODELS.register(LINEAR)
def linear(input_shape, num_classes):
  del input_shape
  return [keras.layers.Dense(num_classes, name="logits")]


@pytest.fixture(scope="module")
def split():
  return data.DATASETS.get("synthetic")(None, 0, None)


@pytest.fixture(scope="module")
def workers(split):
  """NUM_WORKERS workers of the linear model on the appliers' device,
  traced once for the module: a worker's push is a function of the weights
  it is handed and its batch (the harness records the batches)."""
  device = devices.configure(1, "cpu")[0]
  out = []
  for k in range(NUM_WORKERS):
    with tf.device(device):
      model = models.build(LINEAR, split.input_shape, split.num_classes)
    out.append(Worker(k, NUM_WORKERS, device, model,
                      tasks.for_dataset(split), split, BATCH, 0))
  return out


def make_applier(split, **policy):
  device = devices.configure(1, "cpu")[0]
  keras.utils.set_random_seed(0)
  with tf.device(device):
    model = models.build(LINEAR, split.input_shape, split.num_classes)
    optimizer = optim.make("sgd", LR, model.trainable_variables)
    step = tf.Variable(0, dtype=tf.int64)
  return Applier(model, optimizer, step, device, **policy)


def numpy_grads(weights, x, y):
  """Gradient of the mean softmax cross-entropy of x @ kernel + bias."""
  kernel, bias = (np.float64(w) for w in weights)
  logits = x @ kernel + bias
  p = np.exp(logits - logits.max(1, keepdims=True))
  p /= p.sum(1, keepdims=True)
  p[np.arange(len(y)), y] -= 1.0
  return [x.T @ p / len(y), p.mean(0)]


def expected_run(w0, batches, ticks, max_staleness, lr_policy, dc_lambda):
  """The rules in numpy: versions, staleness, drops, lr policy, DC."""
  history = [[np.float64(w) for w in w0]]
  counts, drops = collections.Counter(), 0
  for tick in range(ticks):
    k = tick % NUM_WORKERS
    t = len(history) - 1
    v = max(0, t - k)
    tau = t - v
    if max_staleness >= 0 and tau > max_staleness:
      drops += 1
      continue
    x, y = batches[tick]
    grads = numpy_grads(history[v], x, y)
    grads = [g + dc_lambda * g * g * (now - read)
             for g, now, read in zip(grads, history[t], history[v])]
    scale = lr_policy(tau)
    history.append([w - LR * scale * g for w, g in zip(history[t], grads)])
    counts[tau] += 1
  return history[-1], counts, drops


def forced_run(applier, workers, ticks, replay=None):
  """Drives the real Worker.compute / Applier.offer in the forced order, on
  the workers' next batches or, given `replay`, on those; returns (the
  batches, the staleness of each push)."""
  history = {0: applier.read()[1]}
  batches, seen_taus = [], []
  for tick in range(ticks):
    k = tick % NUM_WORKERS
    v = max(0, applier.version - k)
    x, y = replay[tick] if replay else workers[k].next_batch()
    batches.append((x, y))
    outcome = applier.offer(workers[k].compute(v, history[v], x, y))
    seen_taus.append(outcome.tau)
    if outcome.applied:
      history[applier.version] = applier.read()[1]
  return batches, seen_taus


@pytest.mark.parametrize("max_staleness,lr_name,comp,dc_lambda", [
    (-1, "none", "none", 0.0),  # Unbounded: tau = min(t, k) every time.
    (1, "none", "none", 0.0),  # Workers 2 and 3 are dropped once t >= 2.
    (2, "inverse", "none", 0.0),
    (-1, "inverse", "dc", 0.5),
])
def test_forced_interleaving_gives_exact_variables_and_counts(
    split, workers, max_staleness, lr_name, comp, dc_lambda):
  lr_policy = policies.STALENESS_LR.get(lr_name)
  applier = make_applier(split, max_staleness=max_staleness,
                         staleness_lr=lr_policy,
                         compensation=policies.COMPENSATIONS.get(comp),
                         dc_lambda=dc_lambda)
  w0 = [np.asarray(v) for v in applier.model.trainable_variables]
  ticks = 14
  batches, seen_taus = forced_run(applier, workers, ticks)
  batches = [(x.numpy().astype(np.float64), y.numpy()) for x, y in batches]

  want_w, want_counts, want_drops = expected_run(
      w0, batches, ticks, max_staleness, lr_policy, dc_lambda)
  got_w = [np.asarray(v) for v in applier.model.trainable_variables]
  for got, want in zip(got_w, want_w):
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
  assert max(abs(g - w0_).max() for g, w0_ in zip(got_w, w0)) > 1e-2
  assert applier.staleness.by_tau() == dict(want_counts)
  assert applier.dropped == want_drops
  applied = sum(want_counts.values())
  assert applier.version == int(applier.step.numpy()) == applied
  assert applied + want_drops == ticks
  if max_staleness >= 0:
    assert applier.staleness.max <= max_staleness
    assert want_drops > 0  # The bound was exercised, not just respected.
    assert sum(tau > max_staleness for tau in seen_taus) == want_drops
  else:
    assert applier.staleness.max == NUM_WORKERS - 1


def test_dc_with_zero_lambda_equals_plain_async(split, workers):
  def final(comp, replay=None):
    applier = make_applier(split, compensation=policies.COMPENSATIONS.get(comp),
                           dc_lambda=0.0)
    batches, _ = forced_run(applier, workers, 10, replay)
    return [np.asarray(v) for v in applier.model.trainable_variables], batches

  plain, batches = final("none")
  compensated, _ = final("dc", batches)  # On the same batches.
  for a, b in zip(plain, compensated):
    np.testing.assert_array_equal(a, b)


def test_inverse_lr_step_is_exact_for_known_staleness(split):
  applier = make_applier(split, staleness_lr=policies.inverse)
  variables = applier.model.trainable_variables
  zeros = [tf.zeros_like(v) for v in variables]
  ones = [tf.ones_like(v) for v in variables]
  stale_version, stale_read, _ = applier.read()
  for _ in range(4):  # Four fresh updates that do not move the weights.
    version, read, _ = applier.read()
    assert applier.offer(Push(0, version, zeros, read, {"loss": 0.0})).tau == 0
  before = [np.asarray(v) for v in variables]
  outcome = applier.offer(Push(1, stale_version, ones, stale_read,
                               {"loss": 0.0}))
  assert (outcome.tau, outcome.applied, outcome.lr_scale) == (4, True, 0.25)
  for got, old in zip(variables, before):  # lr / tau = 0.5 / 4, exactly.
    np.testing.assert_array_equal(np.asarray(got),
                                  old - np.float32(LR / 4) * np.float32(1.0))


def test_policies_are_small_functions():
  assert [policies.inverse(t) for t in (0, 1, 2, 4)] == [1.0, 1.0, 0.5, 0.25]
  assert policies.constant(7) == 1.0
  with pytest.raises(UserError, match="registered staleness"):
    policies.STALENESS_LR.get("no_such_rule")


def test_a_policy_an_extension_registers_is_a_valid_flag_value(small_config):
  from experiments.extensions import exp_staleness  # pylint: disable=g-import-not-at-top
  config = configure.validate(small_config(mode="async", staleness_lr="exp"),
                              Cluster())
  assert config.mode_options.staleness_lr == "exp"
  assert policies.STALENESS_LR.get("exp") is exp_staleness.exponential
  assert exp_staleness.exponential(3) == 0.125


# -- float16 loss scaling: overflows are skipped, not applied --


def fp16_trainer(small_config, **overrides):
  """An async trainer in mixed_float16 whose threads never start: the tests
  drive its workers and applier by hand."""
  config = configure.validate(small_config(
      mode="async", precision="mixed_float16", optimizer="adam",
      learning_rate=0.01, **overrides), Cluster())
  names = devices.configure(config.num_devices, "cpu")
  keras.utils.set_random_seed(config.seed)
  return build_trainer(config, names, load_data(config), Cluster())


def fresh_push(trainer, worker):
  """Worker `worker` reads the master (and its scale) and computes a push."""
  version, read, scale = trainer.applier.read()
  x, y = trainer.workers[worker].next_batch()
  return trainer.workers[worker].compute(version, read, x, y, scale)


def test_fp16_workers_unscale_their_gradients(small_config):
  trainer = fp16_trainer(small_config)
  worker = trainer.workers[0]
  assert worker.model.layers[1].compute_dtype == "float16"
  version, read, scale = trainer.applier.read()
  assert scale == 2.0 ** 15
  x, y = worker.next_batch()
  scaled = worker.compute(version, read, x, y, scale)
  plain = worker.compute(version, read, x, y, 1.0)
  assert scaled.loss_scale == scale and plain.loss_scale == 1.0
  for a, b in zip(scaled.grads, plain.grads):  # True gradients, both.
    assert a.dtype == tf.float32
    np.testing.assert_allclose(a, b, rtol=0.05, atol=1e-3)


def test_fp16_overflow_is_skipped_and_halves_the_scale_once(small_config):
  trainer = fp16_trainer(small_config, num_devices=2, async_workers=2)
  applier = trainer.applier
  variables = trainer.model.trainable_variables
  # Inject an overflow: scaled by 2**40, float16 gradients become inf.
  trainer.loss_scale.scale.assign(2.0 ** 40)
  first, second = fresh_push(trainer, 0), fresh_push(trainer, 1)
  before = [np.asarray(v) for v in variables]

  outcome = applier.offer(first)
  assert (outcome.applied, outcome.skipped, outcome.finite) == (
      False, True, True)
  assert applier.current_loss_scale == 2.0 ** 39
  outcome = applier.offer(second)  # Overflowed at 2**40 too: no new halving.
  assert outcome.skipped and applier.current_loss_scale == 2.0 ** 39
  for b, v in zip(before, variables):
    np.testing.assert_array_equal(b, np.asarray(v))
  assert applier.version == int(trainer.step.numpy()) == 0
  assert int(trainer.optimizer.iterations.numpy()) == 0
  assert (applier.applied, applier.skipped, applier.dropped) == (0, 2, 0)

  trainer.loss_scale.scale.assign(2.0 ** 15)
  outcome = applier.offer(fresh_push(trainer, 0))
  assert outcome.applied and not outcome.skipped
  assert max(float(np.abs(b - np.asarray(v)).max())
             for b, v in zip(before, variables)) > 0
  assert applier.version == int(trainer.step.numpy()) == 1
  assert int(trainer.optimizer.iterations.numpy()) == 1
  assert int(trainer.loss_scale.good_steps.numpy()) == 1


def test_fp16_nonfinite_at_the_floor_scale_or_loss_is_an_error(small_config):
  trainer = fp16_trainer(small_config)
  applier = trainer.applier
  version, read, _ = applier.read()
  infs = [tf.fill(v.shape, np.inf) for v in trainer.model.trainable_variables]
  # A non-finite loss is never an overflow, whatever the scale.
  outcome = applier.offer(Push(0, version, infs, read, {"loss": np.inf},
                               2.0 ** 15))
  assert not outcome.finite and not outcome.skipped
  assert applier.current_loss_scale == 2.0 ** 15
  trainer.loss_scale.scale.assign(1.0)  # The floor: nothing left to unscale.
  outcome = applier.offer(Push(0, version, infs, read, {"loss": 1.0}, 1.0))
  assert not outcome.finite and not outcome.skipped
  assert applier.current_loss_scale == 1.0 and applier.skipped == 0
  assert applier.version == 0
