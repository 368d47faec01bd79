"""Research extensions: each module registers a model, dataset, optimizer,
mode, policy or schedule. Importing this package makes them selectable by
flag; the library itself is not edited."""

from experiments.extensions import residual_cnn  # pylint: disable=unused-import
from experiments.extensions import eager_1f1b  # pylint: disable=unused-import
from experiments.extensions import exp_staleness  # pylint: disable=unused-import
from experiments.extensions import single_device  # pylint: disable=unused-import
from experiments.extensions import randomk  # pylint: disable=unused-import
from experiments.extensions import exp_decay  # pylint: disable=unused-import
