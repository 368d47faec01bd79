"""The pipeline timeline as a picture: a device x time Gantt chart.

Drawn with numpy into an HWC uint8 array (for `tf.summary.image` and for PNG
files via `tf.io.encode_png`), so no plotting package is needed. Forwards are
blue, whole backwards green, input gradients (I) teal, weight gradients (W)
orange, a device's later chunks darker; idle time (the bubble) is left
white. Each bar is labelled with its micro-batch (and chunk, `F3.1`) when it
is wide enough, each row with its device. `render_many` stacks charts, e.g.
the measured step above the predicted one, on one time scale.
"""

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from dist_loop.parallel.modes.pipeline import schedule as schedule_lib
from dist_loop.parallel.modes.pipeline import simulator

# A 3x5 pixel font for the labels: only the characters the chart uses.
_FONT = {
    "0": ["111", "101", "101", "101", "111"],
    "1": ["010", "110", "010", "010", "111"],
    "2": ["111", "001", "111", "100", "111"],
    "3": ["111", "001", "111", "001", "111"],
    "4": ["101", "101", "111", "001", "001"],
    "5": ["111", "100", "111", "001", "111"],
    "6": ["111", "100", "111", "101", "111"],
    "7": ["111", "001", "010", "010", "010"],
    "8": ["111", "101", "111", "101", "111"],
    "9": ["111", "101", "111", "001", "111"],
    "F": ["111", "100", "110", "100", "100"],
    "B": ["110", "101", "110", "101", "110"],
    "S": ["111", "100", "111", "001", "111"],
    "G": ["111", "100", "101", "101", "111"],
    "P": ["111", "101", "111", "100", "100"],
    "I": ["111", "010", "010", "010", "111"],
    "E": ["111", "100", "111", "100", "111"],
    "M": ["101", "111", "111", "101", "101"],
    "K": ["101", "101", "110", "101", "101"],
    "R": ["110", "101", "110", "101", "101"],
    "D": ["110", "101", "101", "101", "110"],
    "A": ["010", "101", "111", "101", "101"],
    "L": ["100", "100", "100", "100", "111"],
    "W": ["101", "101", "111", "111", "101"],
    "U": ["101", "101", "101", "101", "111"],
    "C": ["111", "100", "100", "100", "111"],
    "T": ["111", "010", "010", "010", "010"],
    "V": ["101", "101", "101", "101", "010"],
    "H": ["101", "101", "111", "101", "101"],
    "O": ["111", "101", "101", "101", "111"],
    "N": ["110", "101", "101", "101", "101"],
    "Z": ["111", "001", "010", "100", "111"],
    "_": ["000", "000", "000", "000", "111"],
    "=": ["000", "111", "000", "111", "000"],
    ".": ["000", "000", "000", "000", "010"],
    " ": ["000", "000", "000", "000", "000"],
}
COLORS = {schedule_lib.FORWARD: (66, 133, 244),
          schedule_lib.BACKWARD: (52, 168, 83),
          schedule_lib.INPUT_GRAD: (0, 150, 136),
          schedule_lib.WEIGHT_GRAD: (245, 124, 0)}
_WHITE, _BLACK, _GREY = (255, 255, 255), (0, 0, 0), (200, 200, 200)

Bar = simulator.Bar  # device, action, start, end


def bars_from_timestamps(schedule: schedule_lib.Schedule, starts: np.ndarray,
                         ends: np.ndarray) -> List[Bar]:
  """(device, action, start, end) bars of one replica's measured step.

  Args:
    schedule: per-device action lists.
    starts, ends: [K, A] timestamps in each device's schedule order (a
      device with fewer than A actions has its row padded at the end).
  """
  t0 = float(np.min(starts))
  return [(d, action, float(starts[d][j]) - t0, float(ends[d][j]) - t0)
          for d, actions in enumerate(schedule)
          for j, action in enumerate(actions)]


def median_durations(bars: Sequence[Bar]) -> Dict[str, Dict[str, float]]:
  """{device: {kind: the median seconds of its actions of that kind}}."""
  durations = {}
  for d, action, start, end in bars:
    durations.setdefault(str(d), {}).setdefault(action.kind, []).append(
        end - start)
  return {d: {k: float(np.median(v)) for k, v in kinds.items()}
          for d, kinds in durations.items()}


def bars_from_simulation(schedule: schedule_lib.Schedule,
                         forward_time: float = 1.0,
                         backward_time: float = 2.0) -> List[Bar]:
  """Bars of the ideal timeline (equal chunks), from the simulator."""
  if not isinstance(schedule, schedule_lib.Schedule):
    schedule = schedule_lib.Schedule.of(schedule)
  costs = simulator.ChunkCosts.unit(schedule.num_chunks, forward_time,
                                    backward_time)
  return simulator.simulate(schedule, costs).bars


def _text(image: np.ndarray, top: int, left: int, text: str, scale: int,
          color) -> None:
  for c, ch in enumerate(text):
    glyph = _FONT.get(ch, _FONT[" "])
    for gy, row in enumerate(glyph):
      for gx, bit in enumerate(row):
        if bit == "1":
          y0 = top + gy * scale
          x0 = left + (c * 4 + gx) * scale
          image[y0:y0 + scale, x0:x0 + scale] = color


def _color(schedule, action):
  color = np.array(COLORS[action.kind], dtype=float)
  if schedule is not None and schedule.virtual_stages > 1:
    local = schedule.label(action).rsplit(".", 1)[1]
    color *= 0.6 ** int(local)  # Later chunks of a device darker.
  return tuple(int(c) for c in color)


def render(bars: Sequence[Bar], num_stages: int, width: int = 960,
           row_height: int = 36, scale: int = 2, title: str = "",
           schedule: Optional[schedule_lib.Schedule] = None,
           total: Optional[float] = None) -> np.ndarray:
  """Draws `bars` as a Gantt chart; returns an HWC uint8 RGB image.

  Args:
    bars: (device, action, start, end), times from the step's start.
    num_stages: rows (devices).
    width, row_height, scale: pixels (scale: of the 3x5 font).
    title: a line above the chart, in the characters of the small font
      (digits, space, upper-case letters of the labels and the schedule
      names, = _ and .; others are left blank).
    schedule: labels bars with their chunk when devices hold several.
    total: the time the width stands for (default: the last end).
  """
  margin = 8 + 4 * 3 * scale  # Room for the "S0" row labels.
  header = 5 * scale + 8 if title else 0
  height = header + num_stages * row_height + 8
  image = np.full((height, width, 3), _WHITE, dtype=np.uint8)
  if title:
    _text(image, 4, margin, title.upper(), scale, _BLACK)
  image_body = image[header:]
  total = total or max(end for _, _, _, end in bars) or 1.0
  plot = width - margin - 4
  image, full = image_body, image  # Draw the chart below the title.
  for k in range(num_stages):
    top = 4 + k * row_height
    image[top + row_height - 2, margin:margin + plot] = _GREY
    _text(image, top + (row_height - 5 * scale) // 2, 4, f"S{k}", scale,
          _BLACK)
  for k, action, start, end in bars:
    top = 4 + k * row_height + 2
    bottom = 4 + (k + 1) * row_height - 4
    x0 = margin + int(round(start / total * plot))
    x1 = max(x0 + 1, margin + int(round(end / total * plot)))
    image[top:bottom, x0:x1] = _color(schedule, action)
    image[top:bottom, x0] = _BLACK  # A separator between adjacent bars.
    label = str(action) if schedule is None else schedule.label(action)
    text_width = (4 * len(label) - 1) * scale
    if x1 - x0 >= text_width + 4:
      _text(image, top + (bottom - top - 5 * scale) // 2,
            x0 + (x1 - x0 - text_width) // 2, label, scale, _WHITE)
  return full


def render_many(charts: Sequence[Tuple[Sequence[Bar], str]],
                schedule: schedule_lib.Schedule, **kwargs) -> np.ndarray:
  """Charts of one schedule, one above the other, on one time scale.

  Args:
    charts: (bars, title) pairs, e.g. the measured step and the predicted.
    schedule: their schedule (rows, chunk labels).
    **kwargs: passed to `render`.
  """
  total = max(end for bars, _ in charts for _, _, _, end in bars)
  return stack([render(bars, schedule.num_devices, title=title,
                       schedule=schedule, total=total, **kwargs)
                for bars, title in charts])


def stack(images: Sequence[np.ndarray], gap: int = 12) -> np.ndarray:
  """Images one above the other (same width), white gaps between."""
  width = max(im.shape[1] for im in images)
  parts = []
  for im in images:
    pad = np.full((im.shape[0], width - im.shape[1], 3), 255, np.uint8)
    parts += [np.concatenate([im, pad], 1),
              np.full((gap, width, 3), 255, np.uint8)]
  return np.concatenate(parts[:-1], 0)


def write_png(path: str, image: np.ndarray) -> None:
  """Writes an HWC uint8 image as PNG (TensorFlow's encoder)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf.io.write_file(path, tf.io.encode_png(image))
