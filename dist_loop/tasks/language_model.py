"""Language modelling: predict each next byte (or token) of a sequence.

Every position of an example is one prediction, so the loss is the
cross-entropy per byte in nats and the accuracy is next-byte accuracy:
exactly `Classification` over labels of shape [batch, seq_len]. What a
language-model user also reads is bits per byte, the loss in base 2, which
compares with the entropy of the data and with compressors.
"""

import math
from typing import Dict

from dist_loop.tasks.base import TASKS
from dist_loop.tasks.classification import Classification


@TASKS.register("language_model")
class LanguageModel(Classification):
  """Next-token cross-entropy and accuracy; reports bits per byte."""

  def report(self, means: Dict[str, float]) -> Dict[str, float]:
    out = dict(means)
    out["bits_per_byte"] = means["loss"] / math.log(2.0)
    return out
