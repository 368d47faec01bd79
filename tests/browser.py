r"""TensorBoard's pages in headless Chromium, as a user sees them.

Headless Chromium (Debian's `chromium`; `.ci/run` installs it), driven
through the DevTools protocol over a pipe (`--remote-debugging-pipe`: no
port, no WebSocket client), and what its Time Series and HParams pages
show. The HParams dashboard is shadow DOM, which `--dump-dom` leaves out;
the protocol's `Runtime.evaluate` walks it. The tests that load a finished
run's pages are in tests/test_tensorboard.py, beside the checks of that
run's event files: one run and one server for both. `serve` starts that
server.

Run as a script, it makes the README's screenshot (`make screenshots`):

    python tests/browser.py runs/default docs/tensorboard.png
"""

import base64
import contextlib
import gzip
import json
import os
import re
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync",
         "--remote-debugging-pipe")
WINDOW = (1280, 800)
PAGE_TIMEOUT_S = 60
SCREENSHOT = (1280, 620)  # The README's: the two charts, little else.
# The train and eval curves of loss and accuracy, a card each, unsmoothed.
TIME_SERIES = ("?smoothing=0&tagFilter="
               + urllib.parse.quote("^(loss|accuracy)$"))

# Every scalar card: its tag, and the rows of its table that TensorBoard
# fills in from the data it charts: one per run, [run, value, step, relative
# time] at the last step (no smoothing column: smoothing is off).
CARDS_JS = r"""
Array.from(document.querySelectorAll('scalar-card-component')).map(card => ({
  tag: (card.querySelector('tb-truncated-path') || {title: null}).title,
  rows: Array.from(card.querySelectorAll('tb-data-table-content-row'))
      .map(row => row.innerText.split(/\s+/).filter(Boolean)),
  chart: card.querySelector('line-chart') !== null,
}))
"""
# The text of the page, shadow roots included, one string per text node.
TEXT_JS = """
(() => {
  const texts = [];
  const visit = (node) => {
    if (node.nodeName === 'STYLE' || node.nodeName === 'SCRIPT') return;
    if (node.nodeType === Node.TEXT_NODE) {
      const text = node.textContent.trim();
      if (text) texts.push(text);
      return;
    }
    if (node.shadowRoot) visit(node.shadowRoot);
    for (const child of node.childNodes) visit(child);
  };
  visit(document.documentElement);
  return texts;
})()
"""


def find_chromium():
  return next(filter(None, map(shutil.which, BROWSERS)), None)


class Chromium:
  """Headless Chromium with one page, driven by the DevTools protocol over
  file descriptors 3 (its input) and 4 (its output), NUL-separated JSON.
  A context manager: it ends the browser and removes its profile."""

  def __init__(self, binary, window=WINDOW):
    self._profile = tempfile.mkdtemp(prefix="chromium-profile-")
    to_browser, self._in = os.pipe()
    self._out, from_browser = os.pipe()

    def plumb():  # In the child, before exec.
      os.dup2(to_browser, 3)
      os.dup2(from_browser, 4)

    self.process = subprocess.Popen(
        [binary, *FLAGS, f"--user-data-dir={self._profile}",
         f"--window-size={window[0]},{window[1]}", "about:blank"],
        pass_fds=(3, 4), preexec_fn=plumb, stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.close(to_browser)
    os.close(from_browser)
    self._buffer = b""
    self._id = 0
    self._session = None  # Commands before it go to the browser itself.
    try:
      page = [t for t in self.call("Target.getTargets")["targetInfos"]
              if t["type"] == "page"][0]
      self._session = self.call("Target.attachToTarget",
                                targetId=page["targetId"],
                                flatten=True)["sessionId"]
      self.call("Emulation.setDeviceMetricsOverride", width=window[0],
                height=window[1], deviceScaleFactor=1, mobile=False)
    except BaseException:
      self.__exit__()
      raise

  def call(self, method, timeout=PAGE_TIMEOUT_S, **params):
    """Sends one command; returns its result (events are skipped)."""
    self._id += 1
    message = {"id": self._id, "method": method, "params": params}
    if self._session:
      message["sessionId"] = self._session
    os.write(self._in, json.dumps(message).encode() + b"\0")
    deadline = time.time() + timeout
    while True:
      while b"\0" not in self._buffer:
        ready, _, _ = select.select([self._out], [], [],
                                    max(deadline - time.time(), 0))
        chunk = os.read(self._out, 1 << 20) if ready else b""
        if not chunk:
          raise AssertionError(f"chromium did not answer {method}")
        self._buffer += chunk
      raw, self._buffer = self._buffer.split(b"\0", 1)
      reply = json.loads(raw)
      if reply.get("id") == self._id:
        if "error" in reply:
          raise AssertionError(f"{method}: {reply['error']}")
        return reply["result"]

  def open(self, url):
    self.call("Page.navigate", url=url)

  def evaluate(self, expression):
    result = self.call("Runtime.evaluate", expression=expression,
                       returnByValue=True)["result"]
    return result.get("value")

  def wait_for(self, expression, check, what):
    """Evaluates `expression` until `check(value)` returns a true value,
    which it returns."""
    deadline = time.time() + PAGE_TIMEOUT_S
    value = None
    while time.time() < deadline:
      value = self.evaluate(expression)
      found = value is not None and check(value)
      if found:
        return found
      time.sleep(0.2)
    raise AssertionError(f"the page did not show {what} within "
                         f"{PAGE_TIMEOUT_S}s; last seen: {value!r}"[:3000])

  def screenshot(self, path):
    data = self.call("Page.captureScreenshot", format="png")["data"]
    with open(path, "wb") as f:
      f.write(base64.b64decode(data))

  def __enter__(self):
    return self

  def __exit__(self, *exc_info):
    self.process.kill()  # A throw-away profile: nothing to save.
    self.process.wait(timeout=30)
    os.close(self._in)
    os.close(self._out)
    shutil.rmtree(self._profile, ignore_errors=True)


def train_and_eval_cards(cards, runs):
  """{tag: rows} of the loss and accuracy cards once every run in `runs`
  has a row in both, else None."""
  found = {c["tag"]: c["rows"] for c in cards
           if c["tag"] in ("loss", "accuracy") and c["chart"]}
  ok = len(found) == 2 and all(
      any(row[:1] == [run] for row in rows)
      for rows in found.values() for run in runs)
  return found if ok else None


def hparams_row(texts, trial):
  """{column: cell} of the HParams table row of `trial`, once every column
  has a value, else None."""
  if "Trial ID" not in texts:
    return None
  start = texts.index("Trial ID")
  try:
    first = texts.index(trial, start)
  except ValueError:
    return None
  columns = [t for t in texts[start:first] if t != "Show Metrics"]
  row = dict(zip(columns, texts[first:first + len(columns)]))
  numbers = ("eval loss", "eval accuracy", "examples/sec", "wall time (s)")
  complete = all(re.fullmatch(r"[\d.e+-]+", row.get(c, "")) for c in numbers)
  return row if complete else None


def open_time_series(browser, base, workdir_name):
  """Loads the Time Series page of loss and accuracy for the runs of one
  workdir; returns {tag: rows} once both charts show both runs."""
  runs = [f"{workdir_name}/tb/train", f"{workdir_name}/tb/eval"]
  browser.open(f"{base}/{TIME_SERIES}&runFilter="
               f"{urllib.parse.quote('^' + workdir_name + '/')}#timeseries")
  cards = browser.wait_for(
      CARDS_JS, lambda c: train_and_eval_cards(c, runs),
      f"the loss and accuracy charts of {' and '.join(runs)}")
  # The settings pane takes a third of the width; the charts get it.
  browser.evaluate("document.querySelector("
                   "'button[aria-label=\"Close side pane\"]')?.click()")
  time.sleep(1)  # The charts redraw at their new width.
  return cards


SERVER_START_TIMEOUT_S = 90


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def get_json(url):
  with urllib.request.urlopen(url, timeout=10) as r:
    raw = r.read()
    if r.headers.get("Content-Encoding") == "gzip":
      raw = gzip.decompress(raw)
    return json.loads(raw)


@contextlib.contextmanager
def serve(logdir, ready_run, ready_tag, ready_step):
  """A TensorBoard server on `logdir`, once it serves `ready_step` of the
  scalar `ready_tag` of `ready_run` (it lists runs before reading their
  files). Yields its base URL."""
  port = _free_port()
  proc = subprocess.Popen(
      [sys.executable, "-m", "tensorboard.main", "--logdir", logdir,
       "--host", "127.0.0.1", "--port", str(port), "--reload_interval", "1"],
      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  base = f"http://127.0.0.1:{port}"
  url = (f"{base}/data/plugin/scalars/scalars?"
         f"run={urllib.parse.quote(ready_run)}&tag={ready_tag}")
  deadline = time.time() + SERVER_START_TIMEOUT_S
  try:
    while True:
      try:
        served = get_json(url)
        if served and served[-1][1] == ready_step:
          break
      except OSError:
        pass
      if proc.poll() is not None or time.time() > deadline:
        proc.terminate()  # Else reading its stderr would wait for its end.
        _, err = proc.communicate(timeout=30)
        raise AssertionError(
            f"tensorboard did not serve step {ready_step} of {ready_run} "
            f"{ready_tag} in time: " + err.decode()[-2000:])
      time.sleep(0.2)
    yield base
  finally:
    proc.kill()  # It only reads: nothing to lose, and SIGTERM takes seconds.
    proc.wait(timeout=30)


def main(argv):
  """`python tests/browser.py WORKDIR OUT.png`: a screenshot of
  WORKDIR's curves as `tensorboard --logdir` on its parent shows them."""
  if len(argv) != 3 or find_chromium() is None:
    print(__doc__ if len(argv) != 3 else "chromium is not installed",
          file=sys.stderr)
    return 2
  workdir, out = os.path.abspath(argv[1]), argv[2]
  with open(os.path.join(workdir, "summary.json")) as f:
    final_step = json.load(f)["final_step"]
  from dist_loop.runtime import console  # pylint: disable=g-import-not-at-top
  console.start(0)  # TensorFlow, imported below, starts quietly.
  name = os.path.basename(workdir)
  with serve(os.path.dirname(workdir), f"{name}/tb/eval", "accuracy",
             final_step) as base:
    with Chromium(find_chromium(), window=SCREENSHOT) as browser:
      open_time_series(browser, base, name)
      browser.screenshot(out)
  print(f"screenshot: {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
