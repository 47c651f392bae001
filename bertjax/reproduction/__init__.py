"""Reproduction contracts: what each paper config should reach (targets with their sources,
reference points on the way), the on-track check at every eval, and the golden curves that
guard each family's tiny run.

The guide: docs/reproducing.md.
"""

from bertjax.reproduction.contract import Contract, Point, Target
from bertjax.reproduction.registry import golden_contracts

__all__ = ["Contract", "Point", "Target", "golden_contracts"]
