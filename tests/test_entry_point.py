"""The command line: every flagfile runs, and bad input fails at the door.

These run `python -m experiments.train` in new processes, as users do.
"""

import glob
import hashlib
import os
import sys

import pytest

from conftest import REPO, run_launch, run_train
import tensorflow as tf

from dist_loop import train

FLAGFILES = sorted(
    glob.glob(os.path.join(REPO, "experiments", "configs", "*.flags"))
    + glob.glob(os.path.join(REPO, "experiments", "extensions", "*.flags")))
SHORT_RUN = ["--train_steps=4", "--steps_per_loop=2", "--log_every=2",
             "--eval_every=4", "--checkpoint_every=4"]


def launcher_args(flagfile):
  """A flagfile that needs a cluster says so in its first line,
  `# launcher: --num_workers=2 --num_ps=1`; it then runs the way its header
  tells users to run it: `python -m tools.launch ARGS -- python -m
  experiments.train ...`. Returns ARGS, or None for a one-process flagfile."""
  with open(flagfile, encoding="utf-8") as f:
    first = f.readline()
  if not first.startswith("# launcher:"):
    return None
  return first.split(":", 1)[1].split()


@pytest.mark.parametrize("flagfile", FLAGFILES, ids=os.path.basename)
def test_every_flagfile_runs_end_to_end(flagfile, tmp_path):
  workdir = tmp_path / "run"
  args = [f"--flagfile={flagfile}", f"--workdir={workdir}", *SHORT_RUN]
  launcher = launcher_args(flagfile)
  if launcher is None:
    result = run_train(*args)
    assert result.returncode == 0, result.stderr[-3000:]
  else:
    result = run_launch(*launcher, "--", sys.executable, "-m",
                        "experiments.train", *args)
    assert result.returncode == 0, result.stdout[-3000:]
    assert glob.glob(str(workdir / "logs" / "*.log"))
  assert glob.glob(str(workdir / "tb" / "events.out.tfevents.*"))
  assert (workdir / "checkpoints" / "checkpoint").exists()
  assert (workdir / "summary.json").exists()
  flags_txt = (workdir / "flags.txt").read_text()
  assert "--train_steps=4" in flags_txt
  assert f"tensorboard --logdir {workdir}" in result.stdout


def test_flags_txt_reproduces_the_run(tmp_path):
  """flags.txt is a flagfile: rerunning from it resumes the same run."""
  workdir = tmp_path / "run"
  first = run_train("--dataset=synthetic", "--model=mlp", "--num_devices=2",
                    "--global_batch_size=16", f"--workdir={workdir}",
                    *SHORT_RUN)
  assert first.returncode == 0, first.stderr[-3000:]
  again = run_train(f"--flagfile={workdir / 'flags.txt'}")
  assert again.returncode == 0, again.stderr[-3000:]
  assert "nothing to train" in again.stderr


@pytest.fixture(scope="module")
def existing_run(tmp_path_factory):
  """A finished run whose files must survive every bad command."""
  from dist_loop import Config  # pylint: disable=g-import-not-at-top
  workdir = str(tmp_path_factory.mktemp("existing") / "run")
  train.run(Config(workdir=workdir, dataset="synthetic", model="mlp",
                   train_steps=4, steps_per_loop=2, log_every=2,
                   eval_every=4, checkpoint_every=4, global_batch_size=16),
            flags_text="--workdir=" + workdir + "\n")
  return workdir


def _snapshot(directory):
  out = {}
  for root, _, files in os.walk(directory):
    for name in files:
      path = os.path.join(root, name)
      with open(path, "rb") as f:
        out[path] = (os.stat(path).st_mtime_ns, hashlib.sha1(f.read()).digest())
  return out


_GPUS = len(tf.config.list_physical_devices("GPU"))
BAD_INPUT = {
    "batch_not_divisible": (["--num_devices=3", "--global_batch_size=64"],
                            "not divisible by 3 replicas; use 63 or 66"),
    "unknown_dataset": (["--dataset=cifar"], "unknown dataset 'cifar'"),
    "unknown_model": (["--model=resnet"], "unknown model 'resnet'"),
    "unknown_mode": (["--mode=magic"], "--mode"),
    "too_many_devices": (["--num_devices=64", "--global_batch_size=64"],
                         "or fewer"),
    # One more GPU than the machine has (none on CPU-only machines).
    "no_gpu": (["--device_type=gpu", f"--num_devices={_GPUS + 1}",
                f"--global_batch_size={16 * (_GPUS + 1)}"], "GPU(s)"),
    "missing_mnist": (["--dataset=mnist", "--data_dir=/nonexistent"],
                      "/nonexistent/mnist.npz"),
    "stray_argument": (["oops"], "unexpected arguments: oops"),
    "ps_without_cluster": (["--mode=ps"], "python -m tools.launch"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_fails_cleanly_and_touches_nothing(case, existing_run,
                                                     monkeypatch, tmp_path):
  args, message = BAD_INPUT[case]
  monkeypatch.setenv("KERAS_HOME", str(tmp_path / "no_keras_cache"))
  before = _snapshot(existing_run)
  result = run_train("--dataset=synthetic", "--model=mlp",
                     f"--workdir={existing_run}", *args)
  assert result.returncode != 0
  assert message in result.stderr, result.stderr[-2000:]
  assert "Traceback" not in result.stderr, result.stderr[-3000:]
  assert _snapshot(existing_run) == before


def test_bad_input_creates_no_workdir(tmp_path):
  workdir = tmp_path / "new"
  result = run_train("--num_devices=64", f"--workdir={workdir}")
  assert result.returncode != 0
  assert not workdir.exists()
