"""Built-in models."""

from paramserver.models.dlrm import DLRM

__all__ = ["DLRM"]
