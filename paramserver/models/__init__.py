"""Built-in models."""

from paramserver.models.dlrm import DLRM
from paramserver.models.rating import RatingModel

__all__ = ["DLRM", "RatingModel"]
