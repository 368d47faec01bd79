"""The pipeline timeline as a picture: a stage x time Gantt chart of F/B.

Drawn with numpy into an HWC uint8 array (for `tf.summary.image` and for PNG
files via `tf.io.encode_png`), so no plotting package is needed. Forwards are
blue, backwards green, idle time (the bubble) is left white; each bar is
labelled with its micro-batch when it is wide enough, each row with its stage.
"""

from typing import List, Sequence, Tuple

import numpy as np

from dist_loop.modes.pipeline import schedule as schedule_lib

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
    "=": ["000", "111", "000", "111", "000"],
    ".": ["000", "000", "000", "000", "010"],
    " ": ["000", "000", "000", "000", "000"],
}
_COLORS = {schedule_lib.FORWARD: (66, 133, 244),
           schedule_lib.BACKWARD: (52, 168, 83)}
_WHITE, _BLACK, _GREY = (255, 255, 255), (0, 0, 0), (200, 200, 200)

Bar = Tuple[int, schedule_lib.Action, float, float]  # stage, action, start, end


def bars_from_timestamps(schedule: schedule_lib.Schedule, starts: np.ndarray,
                         ends: np.ndarray) -> List[Bar]:
  """(stage, action, start, end) bars of one replica's measured step.

  Args:
    schedule: per-stage action lists.
    starts, ends: [K, 2M] timestamps in each stage's schedule order.
  """
  t0 = float(np.min(starts))
  return [(k, action, float(starts[k][j]) - t0, float(ends[k][j]) - t0)
          for k, actions in enumerate(schedule)
          for j, action in enumerate(actions)]


def bars_from_simulation(schedule: schedule_lib.Schedule,
                         forward_time: float = 1.0,
                         backward_time: float = 2.0) -> List[Bar]:
  """Bars of the ideal timeline (equal stages), from `schedule.simulate`."""
  timeline = schedule_lib.simulate(schedule, forward_time, backward_time)
  return [(k, action, start, end) for k, row in enumerate(timeline)
          for action, start, end in row]


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


def render(bars: Sequence[Bar], num_stages: int, width: int = 960,
           row_height: int = 36, scale: int = 2,
           title: str = "") -> np.ndarray:
  """Draws `bars` as a Gantt chart; returns an HWC uint8 RGB image.

  Args:
    bars: (stage, action, start, end), times from the step's start.
    num_stages: rows.
    width, row_height, scale: pixels (scale: of the 3x5 font).
    title: a line above the chart, in the characters of the small font
      (digits, space, F B S G P I E M K R D A L = and .; others are left
      blank).
  """
  margin = 8 + 4 * 3 * scale  # Room for the "S0" row labels.
  header = 5 * scale + 8 if title else 0
  height = header + num_stages * row_height + 8
  image = np.full((height, width, 3), _WHITE, dtype=np.uint8)
  if title:
    _text(image, 4, margin, title.upper(), scale, _BLACK)
  image_body = image[header:]
  total = max(end for _, _, _, end in bars) or 1.0
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
    image[top:bottom, x0:x1] = _COLORS[action.kind]
    image[top:bottom, x0] = _BLACK  # A separator between adjacent bars.
    label = str(action)
    text_width = (4 * len(label) - 1) * scale
    if x1 - x0 >= text_width + 4:
      _text(image, top + (bottom - top - 5 * scale) // 2,
            x0 + (x1 - x0 - text_width) // 2, label, scale, _WHITE)
  return full


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
