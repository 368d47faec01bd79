r"""Runs every experiment flagfile as its header says and checks its promise.

    make check-flagfiles
    python -m tools.check_flagfiles [--only=default,ps] [--timeout_s=1800] \
        [--root=runs/check_flagfiles] [--record=docs/flagfiles.md]

What it checks and the last results: docs/flagfiles.md. Why it works so:

* A flagfile is the record of an experiment, so the check runs the
  commands its header gives, as written (only `python` becomes this
  interpreter): a flagfile that needs a user module, a launcher or data
  made first (shards.flags' `tools.make_shards`) says so there, and the
  check needs no knowledge of its own. Every command runs in the run's own
  fresh directory, so what a setup command writes (`--out=runs/...`) is
  where the run's flagfile looks for it, and nothing lands in the
  repository.
* Each run gets a fresh directory `--root/NAME` for its workdir and logs:
  the same workdir again would resume the finished run and train nothing.
  Only a directory this tool made (with a `.check_flagfiles` marker) is
  removed first; any other there, unless empty, is refused before anything
  runs, so `--root=runs` cannot delete a training run's workdir.
* Each run is a process group bounded by `--timeout_s`, then SIGTERM, then
  SIGKILL: a launcher's tasks go with it, and a hung run is a broken
  promise, not a hung check.
* The record is rewritten after every run, so a check stopped half-way
  still leaves what it found, and lists the rest as not run.
* It trains every experiment in full, one after another: tens of minutes
  of CPU, which is why it is not part of `make test`.
"""

import argparse
import dataclasses
import datetime
import json
import math
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import time
from typing import Callable, List, Optional, Sequence

CONFIGS = os.path.join("experiments", "configs")
RESULTS_HEADING = "## Last results"
_PROMISE = re.compile(
    r"^#\s*promise:\s*(?P<key>[A-Za-z0-9_/]+)\s*(?P<op>>=|<=)\s*"
    r"(?P<value>[-+0-9.eE]+)\s+at\s+step\s+(?P<step>\d+)\s*$")
_KILL_GRACE_S = 30.0
MARKER = ".check_flagfiles"  # In each run's directory: this tool made it.


class InputError(Exception):
  """A header, page or name the check cannot use."""


@dataclasses.dataclass(frozen=True)
class Promise:
  """`key op value at step step`, as a header states it."""

  key: str
  op: str
  value: float
  step: int

  def __str__(self):
    return f"{self.key} {self.op} {self.value:g} at step {self.step}"

  def judge(self, summary: dict) -> Optional[str]:
    """None if `summary` keeps the promise, else why not."""
    if summary.get("final_step") != self.step:
      return f"ended at step {summary.get('final_step')}"
    got = summary.get(self.key)
    if not isinstance(got, (int, float)) or isinstance(got, bool):
      return f"summary.json has no number {self.key}"
    kept = got >= self.value if self.op == ">=" else got <= self.value
    return None if kept else f"{self.key} = {got:.4g}"


@dataclasses.dataclass(frozen=True)
class Header:
  """What a flagfile's leading comment lines say: its command, its
  promises."""

  path: str
  command: Optional[List[str]]
  promises: List[Promise]
  setup: List[List[str]] = dataclasses.field(default_factory=list)


def read_header(path: str) -> Header:
  """The command and the promises of the flagfile at `path`.

  A command is a comment line that starts with `python` after its `#`,
  with its backslash continuation lines. The run is the first command of
  `experiments.train` or `tools.launch`; the commands before it are its
  setup.

  Raises:
    InputError: a `# promise:` line that does not parse, or a command
      without a promise.
  """
  with open(path, encoding="utf-8") as f:
    lines = [line.rstrip("\n") for line in f]
  comments = []
  for line in lines:
    if not line.startswith("#"):
      break
    comments.append(line)
  command, promises, setup = None, [], []
  i = 0
  while i < len(comments):
    text = comments[i][1:].strip()
    if text.startswith("promise:"):
      match = _PROMISE.match(comments[i])
      if match is None:
        raise InputError(
            f"{path}: cannot read {comments[i]!r}; write it as "
            "'# promise: KEY >= NUMBER at step N' (or <=)")
      promises.append(Promise(match["key"], match["op"],
                              float(match["value"]), int(match["step"])))
    elif command is None and text.startswith("python "):
      words = text
      while words.endswith("\\") and i + 1 < len(comments):
        i += 1
        words = words[:-1] + " " + comments[i][1:].strip()
      words = shlex.split(words)
      if words[:3] in (["python", "-m", "experiments.train"],
                       ["python", "-m", "tools.launch"]):
        command = words
      else:
        setup.append(words)
    i += 1
  if command is not None and not promises:
    raise InputError(f"{path}: the header gives a command but no "
                      "'# promise: KEY >= NUMBER at step N' line")
  return Header(path, command, promises, setup if command else [])


def prepared(command: Sequence[str], workdir: Optional[str]) -> List[str]:
  """`command` with this interpreter for `python`, the repository's
  flagfiles by absolute path (it runs elsewhere), and `workdir` for its
  `--workdir` (None: a setup command, which has none)."""
  out = [sys.executable if word == "python" else word for word in command]
  out = [f"--flagfile={os.path.abspath(w.split('=', 1)[1])}"
         if w.startswith("--flagfile=") else w for w in out]
  if workdir is None:
    return out
  out = [f"--workdir={workdir}" if w.startswith("--workdir=") else w
         for w in out]
  if not any(w.startswith("--workdir=") for w in out):
    raise InputError(f"the command {' '.join(command)!r} has no --workdir")
  return out


@dataclasses.dataclass
class Result:
  """One flagfile's run and verdicts."""

  name: str
  promises: List[Promise]
  broken: List[str]  # One reason per broken promise, or the run's failure.
  seconds: float = 0.0
  measured: List[str] = dataclasses.field(default_factory=list)

  @property
  def kept(self) -> bool:
    return not self.broken


def run_command(command: Sequence[str], log_path: str, timeout_s: float,
                cwd: Optional[str] = None) -> Optional[str]:
  """Runs `command` in `cwd` in its own process group, output to
  `log_path`, with the repository importable. None if it exited 0, else
  why not (after `timeout_s` it is stopped)."""
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
      [os.getcwd()] + [p for p in [env.get("PYTHONPATH")] if p])
  with open(log_path, "w", encoding="utf-8") as log:
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, cwd=cwd, env=env)
    try:
      code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
      os.killpg(proc.pid, signal.SIGTERM)
      try:
        proc.wait(timeout=_KILL_GRACE_S)
      except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
      return f"timed out after {timeout_s:g} s (log: {log_path})"
  return None if code == 0 else f"exit code {code} (log: {log_path})"


Runner = Callable[..., Optional[str]]  # (command, log, timeout, cwd=)


def check(header: Header, root: str, timeout_s: float,
          runner: Runner = run_command) -> Result:
  """Runs one flagfile's setup and command in a fresh directory; judges
  its promises."""
  name = _name(header.path)
  place = os.path.abspath(os.path.join(root, name))
  if place_problem(place):
    raise InputError(place_problem(place))
  try:
    shutil.rmtree(place, ignore_errors=True)  # This tool's own: a fresh run.
    os.makedirs(place)
    with open(os.path.join(place, MARKER), "w", encoding="utf-8") as f:
      f.write("Made by tools.check_flagfiles, which replaces it each run.\n")
  except OSError as e:  # No room, no permission.
    raise InputError(f"{place} cannot be made ({e.strerror or e}); pass a "
                     "--root you can write to") from None
  workdir = os.path.join(place, "workdir")
  start = time.monotonic()
  failure = None
  for i, command in enumerate(header.setup):
    failure = runner(prepared(command, None),
                     os.path.join(place, f"{name}.setup{i}.log"), timeout_s,
                     cwd=place)
    if failure is not None:
      failure = f"setup {' '.join(command[:3])}: {failure}"
      break
  if failure is None:
    failure = runner(prepared(header.command, workdir),
                     os.path.join(place, f"{name}.log"), timeout_s, cwd=place)
  result = Result(name, header.promises, [],
                  seconds=time.monotonic() - start)
  if failure is not None:
    result.broken.append(failure)
    return result
  try:
    with open(os.path.join(workdir, "summary.json"), encoding="utf-8") as f:
      summary = json.load(f)
  except (OSError, ValueError) as e:
    result.broken.append(f"no readable summary.json ({e})")
    return result
  for promise in header.promises:
    got = summary.get(promise.key)
    result.measured.append(f"{promise.key} = {got:.4g}"
                           if isinstance(got, (int, float)) else "–")
    reason = promise.judge(summary)
    if reason is not None:
      result.broken.append(f"{promise}: {reason}")
  return result


def place_problem(place: str) -> Optional[str]:
  """Why `check` may not replace `place`, or None: it removes only what it
  made, a directory with its marker, and uses an empty one."""
  if not os.path.lexists(place):
    return None
  fix = "move it away, or pass another --root"
  if os.path.islink(place) or not os.path.isdir(place):
    return f"{place} exists and is not a directory; {fix}"
  if os.path.isfile(os.path.join(place, MARKER)) or not os.listdir(place):
    return None
  return (f"{place} is not empty and was not made by this check (it has no "
          f"{MARKER}); {fix}")


def args_problem(args: argparse.Namespace) -> Optional[str]:
  """Why the flags cannot make a run, or None: checked before anything
  runs, and before a page or a pipe is opened (opening a pipe waits)."""
  if not (math.isfinite(args.timeout_s) and args.timeout_s > 0):
    return (f"--timeout_s={args.timeout_s:g} is not a positive number of "
            "seconds; pass one such as 1800")
  return _root_problem(args.root) or (
      _record_problem(args.record) if args.record else None)


def _root_problem(root: str) -> Optional[str]:
  above = os.path.abspath(root)  # Or the nearest that exists.
  while not os.path.lexists(above):
    above = os.path.dirname(above)
  if os.path.isdir(above):
    return None
  what = "" if above == os.path.abspath(root) else f": {above}"
  return (f"--root={root}{what} is not a directory; pass a directory, or a "
          "new path under one")


def _record_problem(page: str) -> Optional[str]:
  fix = f"pass a page with a '{RESULTS_HEADING}' heading"
  try:
    mode = os.stat(page).st_mode
  except OSError as e:
    return f"--record={page} cannot be read ({e.strerror}); {fix}"
  if stat.S_ISDIR(mode):
    return f"--record={page} is a directory; {fix}"
  if not stat.S_ISREG(mode):
    return (f"--record={page} is not a regular file (a device, a pipe or a "
            f"socket); {fix}")
  return None


def _name(path: str) -> str:
  return os.path.splitext(os.path.basename(path))[0]


def table(results: Sequence[Result], pending: Sequence[Header] = ()) -> str:
  """A markdown table of the results, then of the flagfiles not run yet."""
  lines = ["| flagfile | promise | measured | minutes | verdict |",
           "| --- | --- | --- | --- | --- |"]
  for r in results:
    verdict = "kept" if r.kept else "BROKEN: " + "; ".join(r.broken)
    lines.append(f"| {r.name} | {'; '.join(map(str, r.promises))} "
                 f"| {'; '.join(r.measured) or '–'} "
                 f"| {r.seconds / 60:.1f} | {verdict} |")
  for h in pending:
    lines.append(f"| {_name(h.path)} | {'; '.join(map(str, h.promises))} "
                 "| – | – | not run |")
  return "\n".join(lines)


def record(page: str, results: Sequence[Result], when: datetime.datetime,
           machine: str, pending: Sequence[Header] = ()) -> None:
  """Replaces what follows `page`'s `## Last results` heading."""
  head = _results_section(page)
  body = (f"{RESULTS_HEADING}\n\n`make check-flagfiles` on "
          f"{when:%Y-%m-%d %H:%M} UTC, {machine}:\n\n"
          f"{table(results, pending)}\n")
  with open(page, "w", encoding="utf-8") as f:
    f.write(head + body)


def _results_section(page: str) -> str:
  """The text of `page` before its `## Last results` heading.

  Raises:
    InputError: the page has no such heading.
  """
  with open(page, encoding="utf-8") as f:
    head, found, _ = f.read().partition(RESULTS_HEADING)
  if not found:
    raise InputError(f"{page} has no '{RESULTS_HEADING}' heading; add it "
                      "where the results should go")
  return head


def flagfiles(only: Sequence[str]) -> List[str]:
  """The flagfiles to check: all, by name, or those `only` names, in its
  order."""
  names = sorted(_name(f) for f in os.listdir(CONFIGS) if f.endswith(".flags"))
  if only:
    unknown = [n for n in only if n not in names]
    if unknown:
      raise InputError(f"--only names no flagfile: {', '.join(unknown)}; "
                       f"choose from {CONFIGS}/*.flags")
    names = list(only)
  return [os.path.join(CONFIGS, n + ".flags") for n in names]


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m tools.check_flagfiles",
      description="Run each experiment flagfile as its header says and check "
      "its '# promise:' lines.")
  parser.add_argument("--only", default="", help="Comma-separated flagfile "
                      "names (without .flags), run in that order; default: "
                      "all.")
  parser.add_argument("--root", default=os.path.join("runs", "check_flagfiles"),
                      help="Where the workdirs and logs go.")
  parser.add_argument("--timeout_s", type=float, default=1800.0,
                      help="Stop a run after this long (a broken promise).")
  parser.add_argument("--record", default="", help="A page whose "
                      f"'{RESULTS_HEADING}' section gets the table.")
  parser.add_argument("--machine", default=f"{os.cpu_count()} cores",
                      help="How the record describes the machine.")
  args = parser.parse_args(argv)
  try:
    problem = args_problem(args)
    if problem:
      raise InputError(problem)
    headers = [read_header(p) for p in
               flagfiles([n for n in args.only.split(",") if n])]
    if args.record:  # Refused before hours of training, not after.
      _results_section(args.record)
    runnable = [h for h in headers if h.command is not None]  # base: nested.
    for h in runnable:  # Refused before the first run, not after it.
      problem = place_problem(os.path.abspath(os.path.join(args.root,
                                                           _name(h.path))))
      if problem:
        raise InputError(problem)
  except (InputError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  results = []
  for i, header in enumerate(runnable):
    print(f"[check_flagfiles] {os.path.basename(header.path)} ...", flush=True)
    try:
      results.append(check(header, args.root, args.timeout_s))
    except InputError as e:  # The place cannot be made, or is not ours now.
      print(f"error: {e}", file=sys.stderr)
      return 2
    print(table(results[-1:]).splitlines()[-1], flush=True)
    if args.record:  # After each run: a stopped check keeps what it found.
      record(args.record, results, _now(), args.machine, runnable[i + 1:])
  print(table(results))
  return 0 if all(r.kept for r in results) else 1


def _now() -> datetime.datetime:
  return datetime.datetime.now(datetime.timezone.utc)


if __name__ == "__main__":
  sys.exit(main())
