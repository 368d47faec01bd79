"""The workdir under abuse, and its lock.

Every way a user can leave a workdir ends either in a resume from what can
still be read, or in one `error:` line with the workdir exactly as it was:
never in a traceback, never in a half-rewritten run. The runs go through the
entry point in this process (`conftest.run_main`); the exit code and the
absence of a traceback in a new process are test_startup.py's (its workers
end with an error found while running).
"""

import errno
import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys

import pytest

from conftest import REPO, run_main
from dist_loop import train
from dist_loop.control.actions import summary as summary_action
from dist_loop.core.errors import UserError
from dist_loop.runtime import workdir

RUN = ["--dataset=synthetic", "--model=mlp", "--global_batch_size=16",
       "--optimizer=sgd", "--steps_per_loop=2", "--log_every=2",
       "--eval_every=100", "--checkpoint_every=2", "--max_checkpoints=5"]


@pytest.fixture(name="finished", scope="module")
def _finished(tmp_path_factory):
  """A run trained to step 6: ckpt-2, -4 and -6, flags.txt, summary.json,
  tb/. Tests abuse a copy."""
  path = tmp_path_factory.mktemp("finished") / "run"
  code, _, err = run_main(*RUN, f"--workdir={path}", "--train_steps=6")
  assert code == 0, err
  return path


@pytest.fixture(name="run_dir")
def _run_dir(finished, tmp_path):
  shutil.copytree(finished, tmp_path / "run")
  return tmp_path / "run"


def _snapshot(directory):
  """Every path under `directory` with its kind, content and mtime."""
  out = {}
  for root, dirs, files in os.walk(directory):
    for name in dirs:
      out[os.path.join(root, name)] = "dir"
    for name in files:
      path = os.path.join(root, name)
      if os.path.islink(path) and not os.path.exists(path):
        out[path] = ("link", os.readlink(path))
        continue
      with open(path, "rb") as f:
        out[path] = (os.stat(path).st_mtime_ns,
                     hashlib.sha1(f.read()).digest())
  return out


def _garbage(n, seed=17):
  return random.Random(seed).randbytes(n)


def _refused(path, *args, message, workdir_arg=None):
  """Runs ARGS on `path`: one error line with `message`, exit 1, no
  traceback, and `path` exactly as it was."""
  before = _snapshot(path) if os.path.isdir(path) else None
  target = path if workdir_arg is None else workdir_arg
  code, out, err = run_main(*RUN, f"--workdir={target}",
                            "--train_steps=8", *args)
  lines = [line for line in err.splitlines() if line.strip()]
  assert code == 1, (out, err)
  assert len(lines) == 1 and lines[0].startswith(
      ("error:", "FATAL Flags parsing error:")), err
  assert message in lines[0], err
  if before is not None:
    assert _snapshot(path) == before
  return lines[0]


# -- a workdir in an odd state: refused, untouched --


def _replace_with_dir(path):
  os.unlink(path)
  os.mkdir(path)


def _replace_with_file(path):
  shutil.rmtree(path)
  with open(path, "w") as f:
    f.write("not a directory\n")


ODD_STATES = {
    "flags_random_bytes": (
        lambda d: (d / "flags.txt").write_bytes(_garbage(200)),
        "flags.txt is not a flagfile (not UTF-8 text"),
    "flags_text_garbage": (
        lambda d: (d / "flags.txt").write_text("lorem ipsum\n--model=mlp\n"),
        "flags.txt is not a flagfile (line 'lorem ipsum'"),
    "flags_empty": (lambda d: (d / "flags.txt").write_text(""),
                    "flags.txt is not a flagfile (it holds no flags)"),
    "flags_is_a_directory": (lambda d: _replace_with_dir(d / "flags.txt"),
                             "flags.txt is a directory"),
    "summary_is_a_directory": (
        lambda d: _replace_with_dir(d / "summary.json"),
        "summary.json is a directory"),
    "checkpoints_is_a_file": (lambda d: _replace_with_file(d / "checkpoints"),
                              "checkpoints is a file"),
    "checkpoints_is_a_dangling_link": (
        lambda d: (shutil.rmtree(d / "checkpoints"),
                   (d / "checkpoints").symlink_to(d / "gone")),
        "checkpoints is a symbolic link to "),
    "lock_is_a_directory": (lambda d: (d / "lock").mkdir(),
                            "lock is a directory, but a run keeps a file"),
    "index_is_a_directory": (
        lambda d: _replace_with_dir(d / "checkpoints" / "checkpoint"),
        "checkpoint is a directory"),
    "tensorboard_dir_is_a_file": (lambda d: _replace_with_file(d / "tb"),
                                  "tb is a file"),
    # The index names checkpoints whose data is gone: nothing to resume
    # from, and flags.txt (whose --train_steps differs) is not rewritten.
    "all_checkpoint_data_deleted": (
        lambda d: [p.unlink() for p in (d / "checkpoints").glob("*.data-*")],
        "no readable checkpoint"),
}


@pytest.mark.parametrize("case", sorted(ODD_STATES))
def test_a_workdir_in_an_odd_state_is_refused_and_untouched(case, run_dir):
  spoil, message = ODD_STATES[case]
  spoil(run_dir)
  _refused(run_dir, message=message)


def test_an_unparseable_flags_txt_is_resumed_with_allow_config_change(
    run_dir):
  (run_dir / "flags.txt").write_bytes(_garbage(200))
  code, out, err = run_main(*RUN, f"--workdir={run_dir}", "--train_steps=8",
                            "--allow_config_change")
  assert code == 0, err
  assert "done: step 8" in out
  assert "--train_steps=8\n" in (run_dir / "flags.txt").read_text()


@pytest.mark.parametrize("where", ["a_file", "under_proc", "under_sys",
                                   "under_a_file", "a_dangling_link",
                                   "under_a_dangling_link"])
def test_a_workdir_that_cannot_be_used_is_refused(where, tmp_path):
  a_file = tmp_path / "a_file"
  a_file.write_text("keep me\n")
  (tmp_path / "link").symlink_to(tmp_path / "gone")
  path, message = {
      "a_file": (a_file, "is a file, not a directory"),
      "under_proc": ("/proc/dist_loop_test/run", "cannot create"),
      "under_sys": ("/sys/dist_loop_test/run", "cannot create"),
      "under_a_file": (a_file / "run", "is a file"),
      "a_dangling_link": (tmp_path / "link", f"{tmp_path}/link is a symbolic "
                          f"link to {tmp_path}/gone, which does not exist; "
                          "create that directory, or remove the link"),
      "under_a_dangling_link": (tmp_path / "link" / "run",
                                f"{tmp_path}/link is a symbolic link to"),
  }[where]
  _refused(tmp_path, message=message, workdir_arg=path)
  assert a_file.read_text() == "keep me\n"
  assert not os.path.exists("/proc/dist_loop_test")


def test_a_workdir_on_a_read_only_filesystem_says_so(tmp_path, monkeypatch):
  """Root may write anywhere but on a read-only filesystem: the cause named
  is the filesystem, not the user. (The filesystem is faked: its flag from
  statvfs, and the access check that follows from it.)"""
  real_statvfs = os.statvfs

  class ReadOnly:
    def __init__(self, path):
      self.f_flag = real_statvfs(path).f_flag | os.ST_RDONLY

  monkeypatch.setattr(os, "statvfs", ReadOnly)
  monkeypatch.setattr(os, "access", lambda *_: False)
  for path, message in ((tmp_path, "is on a read-only filesystem; use "
                         "another --workdir"),
                        (tmp_path / "new", f"cannot be created: {tmp_path} is "
                         "on a read-only filesystem")):
    with pytest.raises(UserError, match=message):
      workdir._check_location(str(path))  # pylint: disable=protected-access
  monkeypatch.setattr(os, "statvfs", real_statvfs)
  with pytest.raises(UserError, match="is not writable by this user"):
    workdir._check_location(str(tmp_path))  # pylint: disable=protected-access


def test_a_lock_file_that_cannot_be_written_names_the_cause(tmp_path,
                                                            monkeypatch):
  """A full disk, a read-only filesystem and permissions each get their own
  fix."""
  real_open = os.open
  for code, fix in ((errno.ENOSPC, "Free some space, then rerun"),
                    (errno.EROFS, "Use a workdir on a filesystem mounted "
                     "read-write"),
                    (errno.EACCES, "Fix the workdir's permissions")):
    def refuse(path, *args, code=code, **kwargs):
      if str(path).endswith("/lock"):
        raise OSError(code, os.strerror(code))
      return real_open(path, *args, **kwargs)
    monkeypatch.setattr(os, "open", refuse)
    with pytest.raises(UserError, match=fix):
      workdir.Lock(str(tmp_path / "run")).acquire()
    assert not (tmp_path / "run").exists()


def test_flag_errors_are_printed_once(tmp_path):
  _refused(tmp_path, message="--workdir is empty", workdir_arg="")
  long_value = "x" * 5000
  line = _refused(tmp_path, f"--optimizer={long_value}",
                  message="unknown --optimizer")
  assert line.count(long_value) == 1


# -- an unreadable index: the checkpoints are found by their names --

INDEX_DAMAGE = {
    "empty": lambda p: p.write_bytes(b""),
    "random_bytes": lambda p: p.write_bytes(_garbage(300)),
    "text_garbage": lambda p: p.write_text("model_checkpoint_path: ???\n}"),
    "missing": lambda p: p.unlink(),
}


@pytest.mark.parametrize("damage", sorted(INDEX_DAMAGE))
def test_an_unreadable_index_falls_back_to_the_newest_checkpoint(
    damage, run_dir, caplog):
  ckpts = run_dir / "checkpoints"
  INDEX_DAMAGE[damage](ckpts / "checkpoint")
  saved = _snapshot(ckpts)
  code, out, err = run_main(*RUN, f"--workdir={run_dir}", "--train_steps=8")
  assert code == 0, err
  assert "done: step 8" in out
  assert "missing or unreadable; trying the checkpoints it should list, " \
      "newest first: ckpt-6, ckpt-4, ckpt-2." in caplog.text
  # Resumed from ckpt-6: no older checkpoint was rewritten or deleted, and
  # the index names the new one.
  after = _snapshot(ckpts)
  assert all(after[p] == v for p, v in saved.items()
             if os.path.basename(p).startswith("ckpt-"))
  assert str(ckpts / "ckpt-8.index") in after
  assert "ckpt-8" in (ckpts / "checkpoint").read_text()


def test_a_summary_that_cannot_be_written_keeps_the_checkpoint(
    small_config, monkeypatch):
  def full_disk(path, data):
    del data
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

  monkeypatch.setattr(summary_action, "atomic_write_json", full_disk)
  cfg = small_config(train_steps=4, steps_per_loop=2, checkpoint_every=4)
  with pytest.raises(UserError, match="newest checkpoint, of step 4, is saved"):
    train.run(cfg)
  assert os.path.exists(os.path.join(cfg.workdir, "checkpoints",
                                     "ckpt-4.index"))
  assert not os.path.exists(os.path.join(cfg.workdir, "summary.json"))


# -- the lock --

HOLD = """
import sys, time
from dist_loop.runtime import workdir
workdir.Lock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(60)
"""


def test_a_second_run_is_refused_while_the_first_holds_the_lock(
    small_config):
  cfg = small_config(train_steps=2, steps_per_loop=2)
  with workdir.Lock(cfg.workdir):
    with pytest.raises(UserError, match=f"in use by another run \\(pid "
                       f"{os.getpid()}, lock {cfg.workdir}/lock\\)"):
      train.run(cfg)
  assert train.run(cfg)["final_step"] == 2
  assert not os.path.exists(os.path.join(cfg.workdir, "lock"))


def test_a_killed_holder_releases_the_lock(tmp_path):
  holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)],
                            cwd=REPO, stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline() == "locked\n"
    with pytest.raises(UserError, match=f"pid {holder.pid},"):
      workdir.Lock(str(tmp_path)).acquire()
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait()
  assert (tmp_path / "lock").exists()  # Left behind, but not held.
  with workdir.Lock(str(tmp_path)):
    assert (tmp_path / "lock").read_text() == f"{os.getpid()}\n"


def test_each_process_of_a_multi_worker_run_has_its_own_lock():
  assert workdir.lock_name(None, 0, True) == "lock"
  assert workdir.lock_name("worker", 0, True) == "lock"
  assert workdir.lock_name("worker", 1, False) == "lock.worker-1"


def test_the_refused_command_exits_1_in_one_line(tmp_path):
  """Through the entry point: the lock is held by this process, as by
  another run. (That an error found while running, not while parsing flags,
  exits 1 in one line without a traceback in a new process is shown by
  test_startup.py's workers, which fail to join their cluster.)"""
  run = tmp_path / "run"
  with workdir.Lock(str(run)):
    code, out, err = run_main(*RUN, f"--workdir={run}", "--train_steps=2")
  assert code == 1, err[-3000:]
  assert not out and "Traceback" not in err
  errors = [l for l in err.splitlines() if l.startswith("error:")]
  assert len(errors) == 1 and err.strip() == errors[0], err[-3000:]
  assert f"in use by another run (pid {os.getpid()}," in errors[0]
  assert not run.exists()  # Created for the lock, removed with it.
