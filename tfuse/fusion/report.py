"""FusionReport: what :func:`tfuse.fuse_model` fused, where, and what it left alone and why."""

from __future__ import annotations

import collections
import dataclasses


@dataclasses.dataclass(frozen=True)
class Fused:
    """One fused pattern: its kind (``"BatchNorm2d+ReLU"``), the modules or nodes it covered, what replaced them."""

    kind: str
    where: tuple[str, ...]
    replacement: str
    residual: bool = False


@dataclasses.dataclass(frozen=True)
class Skipped:
    """A candidate left as it was: where, and why."""

    where: str
    reason: str


@dataclasses.dataclass
class FusionReport:
    """What :func:`tfuse.fuse_model` did, as data, with a readable ``str``.

    Attributes:
        method: ``"fx"`` (the traced computation was rewritten), ``"structural"``
            (the forward did not trace; adjacent layers of ``nn.Sequential``
            containers were fused) or ``"none"``.
        fused: every pattern fused.
        skipped: every candidate left alone, with the reason.
        note: why the method was chosen (the tracing error, for ``"structural"``).

    Example:
        >>> import torch, tfuse
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
        >>> fused, report = tfuse.fuse_model(model)
        >>> str(report)
        'fused 1 Linear+GELU (torch.fx)'
    """

    method: str = "none"
    fused: list[Fused] = dataclasses.field(default_factory=list)
    skipped: list[Skipped] = dataclasses.field(default_factory=list)
    note: str = ""

    def counts(self) -> dict[str, int]:
        """Fused patterns by kind, in the order first seen."""
        return dict(collections.Counter(f.kind for f in self.fused))

    def __str__(self) -> str:
        if self.fused:
            residual = collections.Counter(f.kind for f in self.fused if f.residual)
            parts = []
            for kind, count in self.counts().items():
                extra = f" ({residual[kind]} with residual)" if residual[kind] else ""
                parts.append(f"{count} {kind}{extra}")
            text = "fused " + ", ".join(parts)
        else:
            text = "fused nothing"
        text += {"fx": " (torch.fx)", "structural": " (nn.Sequential neighbours; the forward did not trace)"}.get(
            self.method, ""
        )
        if self.skipped:
            shown = "; ".join(f"{s.where} {s.reason}" for s in self.skipped[:5])
            more = f"; and {len(self.skipped) - 5} more" if len(self.skipped) > 5 else ""
            text += f"; skipped {len(self.skipped)}: {shown}{more}"
        return text
