"""Every kernel template instantiation flashcore can launch, in one table.

Each row: the source file in ``cuda/``, the targets it is compiled for (every supported
architecture, or sm_90a alone for the ``wgmma``/cluster kernels), and the function listing its
instantiations. The names are the launchers' own (each launcher module's name functions build
the strings it launches, from the same tile rules), so the table and the launches cannot drift
apart. The compile tests read it (every row compiled, a stratified sample of each).
"""
from __future__ import annotations

from . import backward, decode, forward

__all__ = ["TABLE", "ANY", "HOPPER", "names"]

ANY = ("sm_80", "sm_90a")      # the architectures the compile tests cover for the portable kernels
HOPPER = ("sm_90a",)

#: (source, targets, instantiations): one row per kernel family
TABLE = (
    ("flash_fwd.cu", ANY, forward.instantiations),
    ("flash_bwd.cu", ANY, backward.instantiations),
    ("flash_decode.cu", ANY, decode.instantiations),
    ("flash_decode.cu", HOPPER, decode.sm90_instantiations),     # cluster merge, FP8 caches
    (forward.SM90_SOURCE, HOPPER, forward.sm90_instantiations),  # the FP8 forward's included
    (backward.SM90_SOURCE, HOPPER, backward.sm90_instantiations),
)


def names(source: str | None = None, target: str | None = None) -> list[str]:
    """The instantiations of ``source`` (every source: None) compiled for ``target`` (any:
    None), in table order."""
    out = []
    for src, targets, fn in TABLE:
        if (source is None or src == source) and (target is None or target in targets):
            out.extend(fn())
    return out
