"""The command line: every flagfile runs, and bad input fails at the door.

The entry point's flag parsing and `main` run in this process
(`conftest.run_main`); one test runs it as a new process, for the exit code
and the absence of a traceback.
"""

import dataclasses
import glob
import hashlib
import json
import os

import pytest
import tensorflow as tf
from absl import flags
from absl.testing import flagsaver

from conftest import REPO, run_main, run_train
from dist_loop import Config, train
from experiments import flags as run_flags
from tools import local_cluster

# base.flags is not a run: every other flagfile nests it.
FLAGFILES = sorted(
    set(glob.glob(os.path.join(REPO, "experiments", "configs", "*.flags"))
        + glob.glob(os.path.join(REPO, "experiments", "extensions", "*.flags")))
    - {os.path.join(REPO, "experiments", "configs", "base.flags")})
SHORT_RUN = ["--train_steps=2", "--steps_per_loop=2", "--log_every=2",
             "--eval_every=2", "--checkpoint_every=2"]
# TensorFlow fixes its thread pools when it starts, so a flagfile's run in
# this process keeps the pools it has.
IN_PROCESS = ["--intra_op_threads=0", "--inter_op_threads=0"]
# Flagfiles whose steps come in rounds: a round that fits the short run.
SHORT_ROUNDS = {"diloco.flags": ["--sync_every=2"],
                "local_sgd.flags": ["--sync_every=2"]}


def launcher_args(flagfile):
  """A flagfile that needs a cluster says so in its first line,
  `# launcher: --num_workers=2 --num_ps=1` (the flags of tools.launch).
  Returns those words, or None."""
  with open(flagfile, encoding="utf-8") as f:
    first = f.readline()
  if not first.startswith("# launcher:"):
    return None
  return first.split(":", 1)[1].split()


def _parse_only(*args):
  """The entry point's flag parsing and checks, without running."""
  with flagsaver.flagsaver():
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["train", *args])
    return run_flags.to_config()


@pytest.mark.parametrize("flagfile", FLAGFILES, ids=os.path.basename)
def test_every_flagfile_runs_end_to_end(flagfile, tmp_path, monkeypatch):
  """In one process, as its header's command says. A flagfile for a
  parameter-server cluster is checked against the cluster its launcher
  makes, without running (tests/test_ps.py runs that mode's clusters)."""
  workdir = tmp_path / "run"
  args = [f"--flagfile={flagfile}", f"--workdir={workdir}", *SHORT_RUN]
  launcher = dict(a[2:].split("=") for a in launcher_args(flagfile) or ())
  if int(launcher.get("num_ps", 0)):
    spec = local_cluster.cluster_spec(int(launcher["num_workers"]),
                                      int(launcher["num_ps"]))
    monkeypatch.setenv("TF_CONFIG", json.dumps(
        {"cluster": spec, "task": {"type": "chief", "index": 0}}))
    assert _parse_only(*args).mode == "ps"
    return
  code, out, err = run_main(
      *args, *IN_PROCESS, *SHORT_ROUNDS.get(os.path.basename(flagfile), ()))
  assert code == 0, err
  assert "done: step 2" in out
  assert f"tensorboard --logdir {workdir}" in out
  assert glob.glob(str(workdir / "tb" / "events.out.tfevents.*"))
  assert tf.train.latest_checkpoint(str(workdir / "checkpoints")).endswith(
      "ckpt-2")
  assert (workdir / "summary.json").exists()
  assert "--train_steps=2\n" in (workdir / "flags.txt").read_text()


def test_every_config_field_is_a_flag():
  fields = {f.name for f in dataclasses.fields(Config)} - {
      "mode_options", "model_options", "dataset_options"}
  assert fields == set(run_flags.RUN_FLAGS)


def test_flags_txt_reproduces_the_run(tmp_path):
  """flags.txt is a flagfile: rerunning from it resumes the same run."""
  workdir = tmp_path / "run"
  code, _, err = run_main("--dataset=synthetic", "--model=mlp",
                          "--num_devices=2", "--global_batch_size=16",
                          f"--workdir={workdir}", *SHORT_RUN)
  assert code == 0, err
  saved = sorted(os.listdir(workdir / "checkpoints"))
  code, out, err = run_main(f"--flagfile={workdir / 'flags.txt'}")
  assert code == 0, err
  assert "done: step 2" in out
  assert sorted(os.listdir(workdir / "checkpoints")) == saved


@pytest.fixture(scope="module")
def existing_run(tmp_path_factory):
  """A finished run whose files must survive every bad command."""
  workdir = str(tmp_path_factory.mktemp("existing") / "run")
  train.run(Config(workdir=workdir, dataset="synthetic", model="mlp",
                   train_steps=2, steps_per_loop=2, log_every=2,
                   eval_every=2, checkpoint_every=2, global_batch_size=16),
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
    "unknown_dataset": (["--dataset=cifar"], "unknown --dataset='cifar'"),
    "unknown_model": (["--model=resnet"], "unknown --model='resnet'"),
    "unknown_optimizer": (["--optimizer=nope"], "unknown --optimizer='nope'"),
    "unknown_mode": (["--mode=magic"], "unknown --mode='magic'"),
    "unknown_flag": (["--num_stagez=2"], "Unknown command line flag"),
    "other_modes_option": (["--num_stages=2"], "--num_stages is an option of "
                           "--mode=pipeline, which this run does not use"),
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
def test_bad_input_fails_in_one_line_and_touches_nothing(
    case, existing_run, monkeypatch, tmp_path):
  args, message = BAD_INPUT[case]
  monkeypatch.setenv("KERAS_HOME", str(tmp_path / "no_keras_cache"))
  before = _snapshot(existing_run)
  code, _, err = run_main("--dataset=synthetic", "--model=mlp",
                          f"--workdir={existing_run}", *args)
  assert code != 0
  assert message in err, err
  lines = [line for line in err.splitlines() if line.strip()]
  assert len(lines) == 1, err  # One error, printed once.
  assert _snapshot(existing_run) == before


def test_bad_input_creates_no_workdir(tmp_path):
  workdir = tmp_path / "new"
  code, _, _ = run_main("--num_devices=64", f"--workdir={workdir}")
  assert code != 0
  assert not workdir.exists()


def test_the_command_exits_non_zero_without_a_traceback(tmp_path,
                                                        monkeypatch):
  """The one new process: an error found while running (not while parsing
  flags) is one line and exit code 1, as for a user."""
  monkeypatch.setenv("KERAS_HOME", str(tmp_path / "no_keras_cache"))
  result = run_train("--dataset=mnist", "--data_dir=/nonexistent",
                     "--model=mlp", f"--workdir={tmp_path / 'run'}")
  assert result.returncode == 1
  assert "Traceback" not in result.stderr, result.stderr[-3000:]
  errors = [l for l in result.stderr.splitlines() if l.startswith("error:")]
  assert len(errors) == 1 and "/nonexistent/mnist.npz" in errors[0]
  assert not (tmp_path / "run").exists()
