"""Drop-in ``nn.Module`` wrappers over tfuse's fused ops."""

from tfuse.nn.add import FusedAdd

__all__ = ["FusedAdd"]
