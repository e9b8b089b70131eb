"""The functional API of tfuse, in the manner of ``torch.nn.functional``."""

from tfuse.ops.add import add

__all__ = ["add"]
