"""The command line: every flagfile runs, and bad input fails at the door.

The entry point's flagfile reading, user modules, flag parsing and `main`
run in this process (`conftest.run_main`); the tests of what only a real
process shows (Ctrl-C) start one. Hostile flag values:
tests/test_flag_fuzz.py; flagfiles: tests/test_flagfiles.py; a user's
module from outside the repository: tests/test_user_modules.py.

Every flagfile is parsed into its Config and validated. These run end to
end, through `main`, from another directory than the repository's:
default.flags (sync, the CNN on digits, histograms), async_exp_staleness
(async with an extension's policy), local_sgd, eager_1f1b (a pipeline with
an extension's schedule, planned from traced costs as a user's run is),
and sharded (the Transformer on pysource, the language-model task, under
ZeRO-3 with AdamW: trained together nowhere else); default.flags' run is
then rerun from its flags.txt, which resumes it. The others build their
trainer (model, data, devices, strategy, compressor, pipeline plan) as
`train.run` does; what each adds to the runs above is trained by:
async (--staleness_lr=inverse): test_async_policies.py; diloco (nesterov
outer steps): test_local_sgd.py; multiworker: default.flags on one device,
test_multiworker.py; pipeline, pipeline_auto, pipeline_hybrid,
pipeline_interleaved, pipeline_zb_h1, pipeline_zbv (their schedules, the
memory bound, 2 replicas of 2 stages): test_pipeline.py,
test_pipeline_v2.py; powersgd, randomk: test_compression.py;
residual_cnn_pipeline, single_device (--jit_compile): test_extensions.py;
transformer (sharded.flags without ZeRO-3), transformer_pipeline:
test_transformer_modes.py. ps.flags is checked against the cluster its
launcher makes (tests/test_ps.py runs that mode's clusters).
"""
import dataclasses
import glob
import hashlib
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import tensorflow as tf
from absl import flags
from absl.testing import flagsaver

import dist_loop
from conftest import REPO, run_main
from helpers import make_trainer
from dist_loop import Config, configure, data, train
from dist_loop.core import options as options_lib
from dist_loop.data import shard_writer
from dist_loop.runtime import cluster as cluster_lib
from experiments import flags as run_flags
from experiments import flagfiles
from experiments import train as entry
from tools import local_cluster

# base.flags is not a run: every other flagfile nests it.
FLAGFILES = sorted(
    set(glob.glob(os.path.join(REPO, "experiments", "configs", "*.flags"))
        + glob.glob(os.path.join(REPO, "experiments", "extensions", "*.flags")))
    - {os.path.join(REPO, "experiments", "configs", "base.flags")})
# The flagfiles run end to end (the module docstring says why these).
END_TO_END = ("async_exp_staleness.flags", "default.flags", "eager_1f1b.flags",
              "local_sgd.flags", "sharded.flags")
# The one whose finished run is then rerun from its flags.txt.
RERUN_FROM_FLAGS_TXT = "default.flags"
SHORT_RUN = ["--train_steps=2", "--steps_per_loop=2", "--log_every=2",
             "--eval_every=2", "--checkpoint_every=2"]
# TensorFlow fixes its thread pools when it starts, so a flagfile's run in
# this process keeps the pools it has.
IN_PROCESS = ["--intra_op_threads=0", "--inter_op_threads=0"]
# Flagfiles whose steps come in rounds: a round that fits the short run.
SHORT_ROUNDS = {"diloco.flags": ["--sync_every=2"],
                "local_sgd.flags": ["--sync_every=2"]}
# Smaller sizes of the same run, so that it traces in seconds: the
# Transformer's widths and context (and one block, unless a pipeline splits
# its blocks), 2 asynchronous workers, and one micro-batch per stage, the fewest every schedule takes, of
# the flagfile's micro-batch size (its activation memory, which
# pipeline_auto.flags bounds).
SMALL_TRANSFORMER = ["--seq_len=16", "--d_model=16", "--num_heads=2",
                     "--mlp_ratio=1"]


def smaller(config):
  """The size overrides for the run of `config` (parsed from a flagfile)."""
  extra = []
  if config.model == "transformer":
    extra += SMALL_TRANSFORMER
    if config.mode != "pipeline":
      extra += ["--num_layers=1"]
  if config.mode == "async":  # 2 workers have staleness as 4 do.
    extra += ["--num_devices=2", "--async_workers=2"]
  if config.mode == "pipeline":
    options = config.mode_options
    microbatch = config.global_batch_size // options.num_microbatches
    extra += [f"--num_microbatches={options.num_stages}",
              f"--global_batch_size={microbatch * options.num_stages}"]
  return extra


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
  """The entry point's flagfile reading, user modules, flag parsing and
  checks, without running."""
  argv = flagfiles.expand_flagfiles(["train", *args])
  entry.load_user_code(argv)
  with flagsaver.flagsaver():
    flags.FLAGS.unparse_flags()
    flags.FLAGS(argv)
    return run_flags.to_config()


@pytest.fixture(name="cluster_of_this_process")
def _cluster_of_this_process():
  """Sets the cluster the entry point uses (`run_flags.cluster()`), then
  lets the next test read TF_CONFIG again."""
  yield run_flags.use_cluster
  run_flags.use_cluster(None)


def _short_args(flagfile, workdir):
  """The flagfile's command, as its header gives it, shortened."""
  return [f"--flagfile={os.path.relpath(flagfile)}", f"--workdir={workdir}",
          *SHORT_RUN, *SHORT_ROUNDS.get(os.path.basename(flagfile), [])]


def test_the_flagfiles_run_end_to_end_exist():
  assert set(END_TO_END) <= set(map(os.path.basename, FLAGFILES))


@pytest.mark.parametrize("flagfile", [f for f in FLAGFILES if os.path.basename(
    f) in END_TO_END], ids=os.path.basename)
def test_a_flagfile_runs_end_to_end(flagfile, tmp_path, monkeypatch):
  """In one process, as its header's command says, from another directory
  than the repository's (nested flagfiles are found next to the file that
  names them)."""
  monkeypatch.chdir(tmp_path)
  workdir = tmp_path / "run"
  args = _short_args(flagfile, workdir)
  args += [*IN_PROCESS, *smaller(_parse_only(*args))]
  code, out, err = run_main(*args)
  assert code == 0, err
  assert "done: step 2" in out
  assert f"tensorboard --logdir {workdir}" in out
  assert glob.glob(str(workdir / "tb" / "events.out.tfevents.*"))
  assert tf.train.latest_checkpoint(str(workdir / "checkpoints")).endswith(
      "ckpt-2")
  assert (workdir / "summary.json").exists()
  assert "--train_steps=2\n" in (workdir / "flags.txt").read_text()
  if os.path.basename(flagfile) == RERUN_FROM_FLAGS_TXT:
    # flags.txt is a flagfile of the same run (every field, defaults
    # included): rerunning from it resumes that run.
    rerun = f"--flagfile={workdir / 'flags.txt'}"
    assert _parse_only(rerun) == _parse_only(*args)
    saved = sorted(os.listdir(workdir / "checkpoints"))
    code, out, err = run_main(rerun)
    assert code == 0, err
    assert "done: step 2" in out
    assert sorted(os.listdir(workdir / "checkpoints")) == saved


@pytest.mark.parametrize("flagfile", [f for f in FLAGFILES if os.path.basename(
    f) not in END_TO_END], ids=os.path.basename)
def test_every_other_flagfile_parses_and_builds_its_trainer(
    flagfile, tmp_path, monkeypatch, cluster_of_this_process, eager_costs):
  """Parsed and validated from another directory, then its trainer built
  as `train.run` builds it (a pipeline's plan from eager costs: the traced
  measurement is eager_1f1b.flags' end to end). A flagfile for a
  parameter-server cluster is checked against the cluster its launcher
  makes, without building."""
  monkeypatch.chdir(tmp_path)
  args = _short_args(flagfile, tmp_path / "run")
  launcher = dict(a[2:].split("=") for a in launcher_args(flagfile) or ())
  if int(launcher.get("num_ps", 0)):
    spec = local_cluster.cluster_spec(int(launcher["num_workers"]),
                                      int(launcher["num_ps"]))
    cluster_of_this_process(cluster_lib.Cluster(spec, "chief", 0))
    assert _parse_only(*args).mode == "ps"
    return
  cluster_of_this_process(None)
  if os.path.basename(flagfile) == "shards.flags":  # As its header makes them.
    shard_writer.write(data.DATASETS.get("digits")(None, 0, None),
                       "arrayrecord", 4, "runs/digits_shards", 0, {})
  config = _parse_only(*args, *IN_PROCESS, *smaller(_parse_only(*args)))
  assert config.train_steps == 2
  trainer = make_trainer(config)
  try:
    assert len(trainer.devices) == config.num_devices
    assert trainer.model.trainable_variables
    assert int(trainer.step.numpy()) == 0
  finally:
    trainer.close()
  assert not (tmp_path / "run").exists()


COMPONENT_FIELDS = dist_loop.core.config.COMPONENT_FIELDS
FLAG_TYPES = {bool: "bool", int: "int", float: "float", str: "string",
              options_lib.AutoBool: "bool or auto"}


def test_every_config_field_is_a_flag_with_its_default_and_type():
  fields = [f for f in dataclasses.fields(Config)
            if f.name not in COMPONENT_FIELDS]
  kinds = {spec.name: spec.type for spec in options_lib.specs(Config)}
  for field in fields:
    flag = flags.FLAGS[field.name]
    default = (None if field.default is dataclasses.MISSING
               else field.default)
    assert flag.default == default, field.name
    assert flag.parser.flag_type() in (FLAG_TYPES[kinds[field.name]],
                                       "string enum"), field.name
    assert field.metadata["help"] in flag.help, field.name
  assert flags.FLAGS["workdir"].default is None  # Required: no default.


def test_every_flag_of_the_run_is_a_config_field_or_a_components_option():
  """A flag defined by hand, beside the generated ones, fails here."""
  ours = {flag.name for module, module_flags
          in flags.FLAGS.flags_by_module_dict().items()
          if module.startswith(("run: ", "options of "))
          for flag in module_flags}
  fields = {f.name for f in dataclasses.fields(Config)} - set(
      COMPONENT_FIELDS)
  assert ours == fields | set(configure.owners())
  assert set(run_flags.RUN_FLAGS) == fields
  assert "run: the run" in flags.FLAGS.flags_by_module_dict()


# The bounds the issues asked for, written out here rather than read from
# the declarations: (lowest valid, highest valid); None: unbounded.
ASKED_BOUNDS = {
    "seed": (0, 2**32 - 1),
    "grace_period_s": (0.1, 3600.0),
    "intra_op_threads": (0, 1024),
    "inter_op_threads": (0, 1024),
    "collective_timeout_s": (0.001, 86400.0),
    "join_timeout_s": (0.001, 86400.0),
    "train_steps": (1, 2**31 - 1),
    "global_batch_size": (1, 2**20),
    "eval_batch_size": (1, 2**20),
    # A step holds at most 2**20 examples: this bound with a batch of 1.
    "grad_accum_steps": (1, 2**20),
    # Above it a loss bound overflows float32 (options.MAX_FLOAT).
    "max_loss": (0.0, 1e30),
}


def _bound_cases():
  """(flag, refused value, accepted value, the bound the refusal names),
  for each bound each run-wide flag declares, and the asked-for ones."""
  cases = set()
  for spec in options_lib.specs(Config):
    lower, upper = ASKED_BOUNDS.get(spec.name, (spec.lower, spec.upper))
    float_ = spec.type is float
    below = (lambda v: math.nextafter(v, -math.inf)) if float_ else (
        lambda v: v - 1)
    above = (lambda v: math.nextafter(v, math.inf)) if float_ else (
        lambda v: v + 1)
    if lower is not None:
      cases.add((spec.name, below(lower), lower, lower))
    if upper is not None:
      cases.add((spec.name, above(upper), upper, upper))
    if spec.above is not None:
      cases.add((spec.name, spec.above, above(spec.above), spec.above))
    if float_:
      cases.add((spec.name, math.nan, spec.default, None))
  return sorted(cases, key=str)


@pytest.mark.parametrize("name, refused, accepted, bound", _bound_cases(),
                         ids=lambda v: str(v))
def test_a_value_just_outside_a_bound_is_refused_at_parse_time(
    name, refused, accepted, bound):
  """In one line that names the bound; the value at the bound passes (with
  a batch of 1, for the bounds that depend on the batch)."""
  base = ["--dataset=synthetic", "--model=mlp", "--workdir=/tmp/unused",
          "--global_batch_size=1"]
  with pytest.raises(flags.IllegalFlagValueError) as refusal:
    with flagsaver.flagsaver():
      flags.FLAGS.unparse_flags()
      flags.FLAGS(["train", *base, f"--{name}={refused!r}"])
  message = str(refusal.value)
  assert "\n" not in message
  assert message.startswith(f"flag --{name}="), message
  if bound is not None:
    assert str(bound) in message or options_lib.show(bound) in message, (
        message)
  assert getattr(_parse_only(*base, f"--{name}={accepted!r}"),
                 name) == accepted


def test_every_bound_asked_for_is_declared():
  specs = {s.name: s for s in options_lib.specs(Config)}
  for name, (lower, upper) in ASKED_BOUNDS.items():
    assert (specs[name].lower, specs[name].upper) == (lower, upper), name


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
    "negative_seed": (["--seed=-1"], "-1 is not an integer in the range "
                      "[0, 4294967295]"),
    "seed_of_2_to_the_32": (["--seed=4294967296"], "in the range "
                            "[0, 4294967295]"),
    "infinite_grace_period": (["--grace_period_s=inf"], "inf is not a number "
                              "in the range [0.1, 3600]"),
    "grace_period_of_1e12": (["--grace_period_s=1e12"], "[0.1, 3600]"),
    "100000_threads": (["--intra_op_threads=100000"], "100000 is not an "
                       "integer in the range [0, 1024]"),
    "huge_straggler": (["--straggler=0:1e300"], "a slow-down factor from 1 "
                       "to 100"),
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


# An error found while running (not while parsing flags) as a new process
# shows it, exit code 1 and one line without a traceback: test_workdir.py's
# test_the_refused_command_exits_1_in_one_line_without_a_traceback.


# -- what the entry point adds around the run --


def _fake_run(summary=None, error=None):
  """A stand-in for `dist_loop.run`: records its cluster, then returns
  `summary` or raises `error`."""
  calls = []

  def run(config, flags_text=None, cluster=None):
    del flags_text
    calls.append((config, cluster))
    if error is not None:
      raise error
    return summary

  return run, calls


CLASSIFIER_SUMMARY = {"final_step": 2, "eval_loss": 0.31, "eval_accuracy":
                      0.912345, "examples_per_sec": 99.6, "skipped_steps": 0}


def test_the_cluster_is_read_once_and_the_run_gets_that_one(
    monkeypatch, cluster_of_this_process):
  cluster_of_this_process(None)
  reads = []
  read = cluster_lib.current
  monkeypatch.setattr(cluster_lib, "current",
                      lambda: reads.append(1) or read())
  run, calls = _fake_run(CLASSIFIER_SUMMARY)
  monkeypatch.setattr(dist_loop, "run", run)
  code, out, err = run_main("--dataset=synthetic", "--model=mlp",
                            "--workdir=/tmp/unused")
  assert code == 0, err
  assert len(reads) == 1
  assert [cluster for _, cluster in calls] == [run_flags.cluster()]
  assert out.splitlines()[0] == ("done: step 2, eval accuracy 0.9123, "
                                 "100 examples/sec")


@pytest.mark.parametrize("summary, line", [
    (CLASSIFIER_SUMMARY, "done: step 2, eval accuracy 0.9123, 100 "
     "examples/sec"),
    ({"final_step": 5, "eval_loss": 1.91, "eval_accuracy": 0.5,
      "eval_bits_per_byte": 2.75559, "examples_per_sec": 10.0},
     "done: step 5, eval accuracy 0.5, bits per byte 2.7556, 10 "
     "examples/sec"),
    ({"final_step": 3, "eval_loss": float("nan"), "examples_per_sec": 1.0},
     "done: step 3, eval loss nan, 1 examples/sec"),
    ({"final_step": 3, "eval_loss": 1.0, "eval_accuracy": None},
     "done: step 3, eval accuracy n/a"),
    ({"final_step": 0, "examples_per_sec": 0.0},
     "done: step 0, no evaluation, 0 examples/sec"),
])
def test_the_done_line_shows_the_tasks_evaluation(summary, line):
  assert entry.done_line(summary) == line


def test_ctrl_c_while_the_run_starts_is_one_line_and_130(monkeypatch):
  """Inside `main` Ctrl-C is a KeyboardInterrupt, so the run's cleanup
  runs; the controller turns one during training into a saved checkpoint
  (tests/test_controller.py)."""
  run, _ = _fake_run(error=KeyboardInterrupt())
  monkeypatch.setattr(dist_loop, "run", run)
  code, out, err = run_main("--dataset=synthetic", "--model=mlp",
                            "--workdir=/tmp/unused")
  assert (code, out) == (130, "")
  assert err == ("error: interrupted (Ctrl-C); rerun the same command to "
                 "resume\n")


def _start(*args, ignore_ctrl_c=False):
  """`python -m experiments.train ARGS`, started and left running;
  `ignore_ctrl_c`: as a script's background job starts it."""
  ignore = lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)
  return subprocess.Popen(
      [sys.executable, "-m", "experiments.train", *args], cwd=REPO,
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
      env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
      preexec_fn=ignore if ignore_ctrl_c else None)


def _wait_for(condition, proc, what):
  """Polls `condition` until it holds; fails if `proc` exits first or after
  a minute (then `proc` is killed)."""
  deadline = time.monotonic() + 60
  while not condition():
    if proc.poll() is not None:
      raise AssertionError(f"exited before it {what}: {proc.stderr.read()}")
    if time.monotonic() > deadline:
      proc.kill()
      proc.communicate()
      raise AssertionError(f"never {what}")
    time.sleep(0.01)


def _interrupt(proc):
  proc.send_signal(signal.SIGINT)
  try:
    return proc.communicate(timeout=60)
  except subprocess.TimeoutExpired:
    proc.kill()
    proc.communicate()
    raise


# A user's module that waits, while it is imported, for the test to say go
# (a bounded wait), then registers a model with an option of its own.
WAITING_MODULE = """
import dataclasses
import os
import time

import keras
from dist_loop.core.options import option
from dist_loop.models import MODELS

HERE = os.path.dirname(os.path.abspath(__file__))
open(os.path.join(HERE, "importing"), "w").close()
deadline = time.monotonic() + 60
while not os.path.exists(os.path.join(HERE, "go")):
  if time.monotonic() > deadline:
    raise TimeoutError("the test never said go")
  time.sleep(0.01)


@dataclasses.dataclass(frozen=True)
class Options:
  waiting_width: int = option(8, "Hidden units of the waiting model.",
                              lower=1)


@MODELS.register("waiting_mlp")
def waiting_mlp(input_shape, num_classes, options):
  del input_shape
  return [keras.layers.Flatten(),
          keras.layers.Dense(options.waiting_width, activation="relu"),
          keras.layers.Dense(num_classes)]


waiting_mlp.Options = Options
"""


def test_ctrl_c_stays_ignored_and_a_users_model_shows_in_helpfull(tmp_path):
  """As a script's background job starts it: Ctrl-C while a user module
  (outside the repository) is imported does nothing; then `--helpfull`
  lists the module's model among --model's choices and its option under
  its name. One process for both checks."""
  outside = tmp_path / "outside"
  outside.mkdir()
  (outside / "waiting.py").write_text(WAITING_MODULE)
  proc = _start(f"--user_modules={outside / 'waiting.py'}", "--helpfull",
                ignore_ctrl_c=True)
  try:
    _wait_for((outside / "importing").exists, proc, "imported the module")
    proc.send_signal(signal.SIGINT)
  finally:
    (outside / "go").touch()
  out, err = proc.communicate(timeout=120)
  assert (proc.returncode, err) == (1, "")  # absl's exit after its help.
  assert "options of --model=waiting_mlp:" in out
  assert "--waiting_width: Hidden units of the waiting model." in out
  model_help = out[out.index("  --model: "):].split("\n  --", 1)[0]
  assert "waiting_mlp" in model_help.split("(registered:", 1)[1], model_help
  assert "--user_modules: Your own modules" in out


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"),
                    reason="reads /proc/PID/maps")
def test_ctrl_c_while_tensorflow_loads_is_one_line_and_130(tmp_path):
  """Interrupted once TensorFlow's libraries are being loaded (they are
  mapped into the process), whatever it does then."""
  proc = _start("--dataset=synthetic", "--model=mlp",
                f"--workdir={tmp_path / 'run'}")

  def loading_tensorflow():
    try:
      with open(f"/proc/{proc.pid}/maps", encoding="utf-8") as f:
        return "tensorflow" in f.read()
    except OSError:
      return False

  _wait_for(loading_tensorflow, proc, "loaded TensorFlow")
  _, err = _interrupt(proc)
  assert proc.returncode == 130, err[-3000:]
  lines = [line for line in err.splitlines() if line.strip()]
  assert len(lines) == 1 and lines[0].startswith(
      "error: interrupted (Ctrl-C)"), err[-3000:]
