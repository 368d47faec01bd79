"""A process's end without the collector's last walks over TensorFlow.

When Python shuts down it clears every module and runs the cyclic garbage
collector again and again over what is left. After a run that is every
traced graph and Keras object: about 2 s of CPU for a small model, more for
a large one, spent freeing memory the operating system takes back anyway.
Frozen objects (`gc.freeze`) are never walked, so freezing them at exit
leaves the rest of the shutdown as it was: atexit handlers, file flushes
and destructors still run.

Only entry points call this (`experiments.train`, `tools.bench`,
`tools.compare`): a library must not change a user's process.
"""

import atexit
import gc


def skip_final_gc() -> None:
  """Freezes every object once the interpreter starts to exit (called
  early, so the freeze runs after the atexit handlers registered later)."""
  atexit.register(gc.freeze)
