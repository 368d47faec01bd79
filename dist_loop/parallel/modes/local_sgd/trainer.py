"""Local SGD and DiLoCo: H steps on each replica's own weights, then one sync.

Each replica trains its own copy of the weights with its own inner optimizer
(`--optimizer`) for `--sync_every=H` steps on its shard of each global batch,
without communicating. Then the replicas all-reduce the pseudo-gradient,
an outer optimizer applies it to the synchronised weights, and every replica
restarts from them (`outer.synchronise`). `--outer_optimizer=average` with
`--outer_learning_rate=1` is periodic model averaging, which with H=1 is
synchronous SGD; `nesterov` with 0.7 and 0.9 is DiLoCo.

Where the weights live. The run builds the model twice under one strategy
(MirroredStrategy, or MultiWorkerMirroredStrategy across processes, as sync
mode picks it). `model` holds the synchronised weights: it changes only at a
synchronisation, alike on every replica, so evaluation, histograms and
checkpoints read it as in every other mode. `replica_model` is the working
copy: its mirrored components are per-replica storage (`replicas.py`), and
the inner optimizer built over it has per-replica slots the same way. The
inner step is the step core's gradient of the replica's own batch mean
(one contributor, `examples_per_update` = the replica's batch), applied with
`optim.apply_reduced`, which reduces nothing: each component takes its own
replica's update, applied or skipped by that replica (`per_replica_ok`). This keeps one strategy, one sharded input pipeline and
the step core, and spans processes unchanged. The alternatives lose that:
ON_READ variables checkpoint and read back as one aggregate, and a model per
device outside the strategy cannot span processes.

Communication. Only a synchronisation all-reduces: `bytes_per_sync`, the
pseudo-gradient (and any non-trainable float weights), which `report` and
`summary` count per step under the names every all-reducing mode uses
(`compression.wire`: `comm/bytes_per_step`, and its ratio to what float32
sync sends). Not counted, as in sync mode: the loop's metrics, which the
loop base sums per replica and gathers once per loop (`modes/loop.py`), so
inner steps run no collective, even across processes; and the gather of
the replicas' state when a checkpoint is saved. A non-finite step is not
applied on its replica and is reported when the loop ends. There is no
reduced gradient per step, so no `train/grad_norm`:
`local_sgd/replica_grad_norm` is the mean over replicas of the norm of
each replica's own gradient.

`--train_steps` counts inner steps and must be a multiple of H, so that the
last steps reach the model. Checkpoints hold `step`, `model` (the
synchronised weights) and `optimizer` (the inner optimizer; its checkpoint
holds the first replica's slots), as in every mode, plus `outer_optimizer`
and `replicas` (every replica's weights and inner state). So a resume is
exact, mid-period too (a checkpoint on SIGTERM, or a rollback), and a local
SGD checkpoint restores in sync mode; a sync checkpoint lacks the last two
items, so it does not restore here.
"""

from typing import Dict

import tensorflow as tf

from dist_loop import models
from dist_loop.core.errors import UserError
from dist_loop.parallel import compression
from dist_loop.parallel.modes.base import MODES, Report, Reporting
from dist_loop.parallel.modes.local_sgd import outer
from dist_loop.parallel.modes.local_sgd.options import LocalSGDOptions
from dist_loop.parallel.modes.loop import LoopTrainer, StepResult
from dist_loop.parallel.modes.mirrored import Mirrored
from dist_loop.training import optim, replicas
from dist_loop.training import step as step_core

REPLICA_GRAD_NORM = "local_sgd/replica_grad_norm"


@MODES.register("local_sgd")
class LocalSGDTrainer(Mirrored, LoopTrainer, Reporting):
  """Inner steps in `strategy.run` without collectives; a sync every H."""

  Options = LocalSGDOptions
  # float16 would need a loss scale per replica; bfloat16 needs none.
  precisions = ("float32", "mixed_bfloat16")
  grad_accumulation = True
  replicas_agree = False  # Each replica applies its own update.
  reported_means = (REPLICA_GRAD_NORM,)

  @classmethod
  def validate(cls, config, cluster):
    super().validate(config, cluster)
    _check_options(config.mode_options, config.train_steps)

  @classmethod
  def async_checkpoint_refusal(cls, config):
    del config
    return ("--mode=local_sgd checkpoints each replica's own state, which "
            "is not a variable the background save can copy")

  def __init__(self, config, devices, dataset, cluster):
    super().__init__(config, devices, dataset, cluster)
    self.is_chief = cluster.is_chief
    self.strategy = self.build_strategy()
    self.replica_count = self.strategy.num_replicas_in_sync
    self.examples_per_replica = self.examples_per_step // self.replica_count
    self.loss_scale = None
    with self.strategy.scope():
      # The synchronised weights first: the same initial weights as sync.
      self.model = models.build_for(config, dataset)
      self.replica_model = models.build_for(config, dataset)
      self.optimizer = optim.make(config.optimizer, config.learning_rate,
                                  self.replica_model.trainable_variables,
                                  config.weight_decay)
      self.outer_optimizer = outer.make(self.options,
                                        self.model.trainable_variables)
      agg = tf.VariableAggregation.ONLY_FIRST_REPLICA
      self.step = tf.Variable(0, dtype=tf.int64, trainable=False,
                              name="step", aggregation=agg)
      self.pseudo_gradient_norm = tf.Variable(
          0.0, trainable=False, name="pseudo_gradient_norm", aggregation=agg)
    for mine, synced in zip(self.replica_model.weights, self.model.weights):
      mine.assign(synced)  # Cross-replica: every replica starts alike.
    self.replica_state = replicas.ReplicaState(
        self.strategy, self.replica_model.variables + self.optimizer.variables)
    self.bytes_per_sync = outer.bytes_per_sync(self.model)
    self.float32_bytes_per_step = compression.wire.float32_bytes_per_step(
        self.model.trainable_variables)

  def checkpoint_items(self):
    return {"step": self.step, "model": self.model,
            "optimizer": self.optimizer,
            "outer_optimizer": self.outer_optimizer,
            "replicas": self.replica_state}

  def seeded_model(self):
    return self.replica_model  # The copy a step trains.

  def loop_begin(self, start, num_steps):
    self.replica_state.apply()  # After a restore: each replica's own state.
    return super().loop_begin(start, num_steps)

  # -- the replica's inner step, and the synchronisation --

  def replica_step(self, batch, variant):
    """One step of the replica's own weights on its own batch."""
    del variant
    x, y = batch
    chunks = self.config.grad_accum_steps
    shares, grads = step_core.accumulated_gradients(
        self.task, self.replica_model, x, y, chunks=chunks,
        examples_per_update=self.examples_per_replica, contributors=chunks,
        jit_compile=self.config.jit_compile)
    ok = tf.logical_and(optim.all_finite(grads),
                        tf.math.is_finite(shares["loss"]))
    # Clipping acts per inner step, on the replica's own gradient.
    norm = tf.linalg.global_norm(grads)
    grads, means = self.recipe.clip(grads, norm)
    optim.apply_reduced(self.optimizer, grads,
                        self.replica_model.trainable_variables, ok,
                        per_replica_ok=True,
                        learning_rate=self.recipe.rate(self.step))
    # The replica's batch is 1/R of the step's: its share of the step's mean.
    shares = {k: v / self.replica_count for k, v in shares.items()}
    return StepResult(shares, ok, {REPLICA_GRAD_NORM: norm, **means})

  def after_step(self):
    tf.cond(self.step % self.options.sync_every == 0,
            lambda: self.strategy.run(self._synchronise), lambda: None)

  def _synchronise(self):
    norm = outer.synchronise(self.model, self.replica_model,
                             self.outer_optimizer)
    replicas.write([self.pseudo_gradient_norm], [norm])

  # -- Reporting: bytes on the wire --

  def _bytes(self):
    """(bytes per step, bytes so far): a sync's bytes spread over H."""
    per_step = self.bytes_per_sync / self.options.sync_every
    syncs = int(self.step.numpy()) // self.options.sync_every
    return per_step, float(syncs * self.bytes_per_sync)

  def report(self) -> Report:
    per_step, _ = self._bytes()
    return Report(scalars={
        **compression.wire.scalars(per_step, self.float32_bytes_per_step),
        "local_sgd/pseudo_gradient_norm": float(
            self.pseudo_gradient_norm.numpy())})

  def summary(self) -> Dict[str, object]:
    per_step, total = self._bytes()
    return compression.wire.summary(per_step, total,
                                    self.float32_bytes_per_step)


def _check_options(options: LocalSGDOptions, train_steps: int) -> None:
  """The rules between the mode's options. Raises UserError."""
  h = options.sync_every
  if options.outer_optimizer == "average" and options.outer_momentum:
    raise UserError(f"--outer_momentum={options.outer_momentum:g} needs "
                    "--outer_optimizer=nesterov; drop it for average")
  if options.outer_optimizer == "nesterov" and not (
      0 < options.outer_momentum < 1):
    raise UserError(f"--outer_optimizer=nesterov needs 0 < --outer_momentum "
                    f"< 1 (DiLoCo: 0.9), got {options.outer_momentum:g}; "
                    "without momentum use --outer_optimizer=average")
  rest = train_steps % h
  if rest:
    lower = train_steps - rest
    fix = f"{lower} or {lower + h}" if lower else f"{h}"
    raise UserError(f"--train_steps={train_steps} is not a multiple of "
                    f"--sync_every={h}: its last {rest} steps would never "
                    f"reach the model; use --train_steps={fix}")
