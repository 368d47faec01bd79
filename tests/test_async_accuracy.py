"""Seeded async training on digits ends close to sync at the same updates.

Four workers make gradients about two updates stale; with Adam and 600
updates of 64 examples the MLP converges anyway, to within MAX_GAP of a
sync run of the same config on one device that the test makes (N devices
equal one, test_sync_equivalence.py). The async number varies a little
because the thread interleaving does; a broken async (updates lost,
applied to the wrong version, or not at all) misses the bound by far more.
Run with `pytest -s` to see both numbers.
"""

from dist_loop import train

STEPS = 600
MAX_GAP = 0.02
COMMON = dict(dataset="digits", model="mlp", global_batch_size=64,
              optimizer="adam", learning_rate=1e-3, train_steps=STEPS,
              steps_per_loop=STEPS, log_every=STEPS, eval_every=STEPS,
              checkpoint_every=STEPS)


def test_async_matches_sync_accuracy_on_digits(small_config, tmp_path):
  sync = train.run(small_config(workdir=str(tmp_path / "sync"), mode="sync",
                                num_devices=1, **COMMON))
  async_ = train.run(small_config(
      workdir=str(tmp_path / "async"), mode="async", num_devices=4,
      async_workers=4, **dict(COMMON, steps_per_loop=50)))
  print(f"sync {sync['eval_accuracy']:.4f}, async "
        f"{async_['eval_accuracy']:.4f}")
  assert sync["final_step"] == async_["final_step"] == STEPS
  assert async_["async_staleness_mean"] > 1  # Really asynchronous.
  assert async_["eval_accuracy"] >= sync["eval_accuracy"] - MAX_GAP, (
      f"async eval accuracy {async_['eval_accuracy']:.4f} after {STEPS} "
      f"updates, sync {sync['eval_accuracy']:.4f} (mean staleness "
      f"{async_['async_staleness_mean']:.2f})")
