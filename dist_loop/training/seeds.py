"""A model's random layers seeded from the step, so a resume repeats them.

A Keras random layer (`Dropout`, and any layer drawing from a
`keras.random.SeedGenerator`) draws each mask with a stateless random op
whose seed is its generator's state variable, and advances that state by
one per draw. The state is not in the checkpoint (Keras does not track it
for TensorFlow's), so a resumed run would start it over and draw other
masks than the uninterrupted run.

The loop base (`modes/loop.py`) therefore writes every generator's state
before each step, on each replica, as a function of the run's seed, the
generator's place in the model, the step and the replica (`reseed`): a
step's masks are the same however the run reached it (resumed, rolled
back, retraced), and replicas draw different masks. Within a step the
generator advances as Keras advances it.

The new state is hashed, not counted: Keras reduces each component modulo
2**31 - 2 before it draws (XLA's random ops take int32 seeds), so a step
counted into one component would come back to an earlier step's seeds in
a long run; two hashed components keep about 62 bits.
"""

from typing import List

import tensorflow as tf

# The name Keras gives a SeedGenerator's state variable.
STATE_NAME = "seed_generator_state"


def generator_states(model) -> List[object]:
  """The state variables of `model`'s seed generators, in the model's
  order."""
  return [v for v in model.non_trainable_variables
          if v.name == STATE_NAME and tuple(v.shape) == (2,)]


def reseed(states, seed: int, step, replica) -> None:
  """Writes each of `states` (`generator_states`) from (`seed`, its index,
  `step`, `replica`). Traced; in a replica's context, each replica writes
  its own copy.

  Args:
    states: the generators' state variables.
    seed: the run's seed (`--seed`).
    step: int scalar: the step about to run (the count of steps before it).
    replica: int scalar: the replica's index among all replicas.
  """
  step = tf.cast(step, tf.int64)
  replica = tf.cast(replica, tf.int64)
  for index, state in enumerate(states):
    key = tf.random.fold_in(
        tf.random.fold_in(tf.constant([seed, index], tf.int64), step),
        replica)
    state.assign(tf.cast(tf.random.stateless_uniform(
        [2], key, minval=None, maxval=None, dtype=tf.int64), state.dtype))
