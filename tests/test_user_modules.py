"""`--user_modules`: a user's module from outside the repository.

A module written to a temporary directory registers a model with an option
of its own, and logs as it builds. It trains through the entry point in
this process (`conftest.run_main`, which loads user modules as the entry
point does), then a new process resumes the run from its flags.txt alone,
from another directory, and shows the module's log line at the default
verbosity. `--helpfull` (and Ctrl-C during the import) is
tests/test_entry_point.py's. A module that cannot be imported is one line
and exit code 2, for each way it fails. The worked examples of
experiments/extensions load the same way (their flagfiles name them).
"""

import ast
import glob
import os
import signal

import pytest
import tensorflow as tf

from conftest import run_main, run_train
from helpers import kept_registrations
from experiments import flagfiles
from experiments import train as entry
from experiments import user_modules

MODULE = '''
"""A researcher's model, outside the repository."""
import dataclasses

import keras
from absl import logging
from dist_loop.core.options import option
from dist_loop.models import MODELS


@dataclasses.dataclass(frozen=True)
class Options:
  {name}_width: int = option(8, "Hidden units.", lower=1, layout=True)


@MODELS.register("{name}")
def build(input_shape, num_classes, options):
  del input_shape
  logging.info("building {name} of width %d", options.{name}_width)
  return [keras.layers.Flatten(),
          keras.layers.Dense(options.{name}_width, activation="relu"),
          keras.layers.Dense(num_classes)]


build.Options = Options
'''
SHORT_RUN = ["--dataset=synthetic", "--train_steps=2", "--steps_per_loop=2",
             "--log_every=2", "--eval_every=2", "--checkpoint_every=2",
             "--global_batch_size=16"]


@pytest.fixture(name="registrations")
def _registrations():
  """What a user's module registers is undone after the test."""
  with kept_registrations():
    yield


def _write(directory, name, text):
  directory.mkdir(parents=True, exist_ok=True)
  path = directory / name
  path.write_text(text)
  return path


def test_a_module_outside_the_repo_trains_and_a_new_process_resumes_it(
    tmp_path, monkeypatch, registrations):
  """Given as a relative path, trained here; flags.txt records the path
  made absolute, so a new process in another directory resumes the run
  from flags.txt alone, and shows the module's own log line."""
  del registrations
  _write(tmp_path / "research", "outside_mlp.py",
         MODULE.format(name="outside_mlp"))
  monkeypatch.chdir(tmp_path)
  workdir = tmp_path / "run"
  code, out, err = run_main("--user_modules=research/outside_mlp.py",
                            "--model=outside_mlp", "--outside_mlp_width=16",
                            f"--workdir={workdir}", *SHORT_RUN)
  assert code == 0, err
  assert "done: step 2" in out
  flags_txt = (workdir / "flags.txt").read_text()
  assert flags_txt.startswith(
      f"--user_modules={tmp_path / 'research' / 'outside_mlp.py'}\n")
  assert "--outside_mlp_width=16\n" in flags_txt
  reader = tf.train.load_checkpoint(str(workdir / "checkpoints"))
  widths = {tuple(shape) for shape in reader.get_variable_to_shape_map()
            .values()}
  assert (16,) in widths  # The hidden layer's bias: the option was used.

  (tmp_path / "elsewhere").mkdir()
  monkeypatch.chdir(tmp_path / "elsewhere")
  result = run_train(f"--flagfile={workdir / 'flags.txt'}",
                     "--train_steps=4", timeout=180)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "done: step 4" in result.stdout
  assert tf.train.latest_checkpoint(str(workdir / "checkpoints")).endswith(
      "ckpt-4")
  assert "building outside_mlp of width 16" in result.stderr


def _package(tmp_path):
  _write(tmp_path / "pkg", "__init__.py", "import pkg.inner\n")
  _write(tmp_path / "pkg", "inner.py", "raise RuntimeError('no GPU here')\n")
  return "pkg"


def _special(directory, name, make):
  """A path that exists but is no regular file (never to be opened)."""
  directory.mkdir(parents=True, exist_ok=True)
  path = directory / name
  make(str(path))
  return path


# name -> (write the module(s) and return the item, the error line).
FAILURES = {
    "missing_name": (lambda d: "no_such_research_module",
                     "--user_modules=no_such_research_module: cannot import "
                     "it: no module named 'no_such_research_module' on "
                     "sys.path; give its path, or run from the directory "
                     "above it"),
    "missing_file": (lambda d: str(d / "nowhere.py"),
                     "cannot import it: no such .py file or package "
                     "directory"),
    "fifo": (lambda d: str(_special(d, "fifo.py", os.mkfifo)),
             "cannot import it: not a regular file (a FIFO, device or "
             "socket); give a .py file or a package directory"),
    "link_to_a_device": (lambda d: str(_special(
        d, "zero.py", lambda p: os.symlink("/dev/zero", p))),
                         "cannot import it: not a regular file"),
    "exits_0": (lambda d: str(_write(d, "quits.py", "import sys\n"
                                     "sys.exit(0)\n")),
                "cannot import it: SystemExit: 0 (quits.py:2); a module "
                "must not exit while imported"),
    "exits_with_a_message": (lambda d: str(_write(
        d, "bye.py", "raise SystemExit('bye')\n")),
                             "cannot import it: SystemExit: bye (bye.py:1)"),
    "not_a_name": (lambda d: "my-module",
                   "--user_modules=my-module: cannot import it: not a "
                   "module name nor a path"),
    "syntax_error": (lambda d: str(_write(d, "broken.py", "x = (\n")),
                     "cannot import it: SyntaxError: '(' was never closed "
                     "(broken.py:1)"),
    "raises": (lambda d: str(_write(d, "raising.py", "import os\n"
                                    "x = 1 / 0\n")),
               "cannot import it: ZeroDivisionError: division by zero "
               "(raising.py:2)"),
    "package_raises": (lambda d: str(d / _package(d)),
                       "cannot import it: RuntimeError: no GPU here "
                       "(inner.py:1)"),
    "directory_without_init": (lambda d: str(_write(d, "notes.txt", "")
                                              .parent),
                               "cannot import it: a directory without "
                               "__init__.py"),
    "name_taken": (lambda d: str(_write(d, "json.py", "")),
                   "cannot import it: the module name 'json' is taken by "),
    "option_clashes": (lambda d: str(_write(d, "clash.py", MODULE.format(
        name="clash").replace("clash_width", "seed"))),
                       "option --seed of --model=clash has the name of "
                       "another flag; rename the option"),
}


@pytest.mark.parametrize("case", sorted(FAILURES))
def test_a_module_that_cannot_be_imported_is_one_line_and_exit_2(
    case, tmp_path, monkeypatch, registrations, capsys):
  """Through the entry point's own start (`before_the_flags`), before
  absl parses: one line naming the module and the cause, exit code 2, and
  no workdir."""
  del registrations
  make, message = FAILURES[case]
  item = make(tmp_path / "outside")
  # console.start sets TensorFlow's native log level: put it back after.
  monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL",
                     os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))
  with pytest.raises(SystemExit) as exit_:
    entry.before_the_flags(["train", f"--user_modules={item}",
                            f"--workdir={tmp_path / 'run'}"])
  assert exit_.value.code == 2
  err = capsys.readouterr().err
  assert err.startswith(f"error: --user_modules={item}")
  assert message in err and err.count("\n") == 1, err
  assert not (tmp_path / "run").exists()


def test_a_keyboard_interrupt_of_the_modules_own_is_one_line(
    tmp_path, monkeypatch, registrations, capsys):
  """During start-up Ctrl-C exits at once (`train.exit_on_ctrl_c`), so a
  KeyboardInterrupt there is the module's own: one line, exit code 2.
  Where Ctrl-C raises (Python's handler), it may be the user's: it goes
  on."""
  del registrations
  item = str(_write(tmp_path / "outside", "interrupts.py",
                    "raise KeyboardInterrupt\n"))
  monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL",
                     os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))
  previous = signal.signal(signal.SIGINT, lambda signum, frame: None)
  try:
    with pytest.raises(SystemExit) as exit_:
      entry.before_the_flags(["train", f"--user_modules={item}",
                              f"--workdir={tmp_path / 'run'}"])
  finally:
    signal.signal(signal.SIGINT, previous)
  assert exit_.value.code == 2
  err = capsys.readouterr().err
  assert err == (f"error: --user_modules={item}: cannot import it: "
                 "KeyboardInterrupt: (no message) (interrupts.py:1); a "
                 "module must not exit while imported\n")
  assert not (tmp_path / "run").exists()
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    with pytest.raises(KeyboardInterrupt):
      user_modules.load([item])
  finally:
    signal.signal(signal.SIGINT, previous)


def test_the_worked_examples_load_by_flag():
  """Nothing imports experiments/extensions (its package imports nothing):
  each of its flagfiles names the modules it uses, as a user's would."""
  examples = os.path.join(os.path.dirname(entry.__file__), "extensions")
  with open(os.path.join(examples, "__init__.py"), encoding="utf-8") as f:
    tree = ast.parse(f.read())
  assert not [n for n in ast.walk(tree)
              if isinstance(n, (ast.Import, ast.ImportFrom))]
  for flagfile in glob.glob(os.path.join(examples, "*.flags")):
    argv = flagfiles.expand_flagfiles(["train", f"--flagfile={flagfile}"])
    modules = flagfiles.requested_user_modules(argv)
    assert modules, flagfile
    for module in modules:
      assert module.startswith("experiments.extensions."), flagfile
      assert os.path.exists(os.path.join(
          examples, module.rsplit(".", 1)[1] + ".py")), module
