"""Inside an activation checkpoint's recompute: the forward runs again in backward, and nothing should count twice."""

from __future__ import annotations

from lightning_opkit.core.patch import Nesting

__all__ = ["RECOMPUTING"]

#: inside a checkpointed region's forward run again in backward (census steps do not count its ops twice)
RECOMPUTING = Nesting()
