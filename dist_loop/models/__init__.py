"""Models (a name registry of ordered layer lists)."""

from dist_loop.models import cnn, mlp  # Registers the models.
from dist_loop.models import deep_mlp, transformer  # pylint: disable=unused-import
from dist_loop.models.base import (MODELS, build, build_for, image_size_for,
                                   split_points_for, takes)

__all__ = ["MODELS", "build", "build_for", "image_size_for",
           "split_points_for", "takes"]
