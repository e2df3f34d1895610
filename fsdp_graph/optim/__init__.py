"""Optimizers for `fully_shard`-ed parameters whose updates need each matrix whole (docs/optim.md).

    whole_matrix.py   `WholeMatrixOptimizer`: the owner machinery (each matrix updated once in the
                      world, on its owner; pieces gathered and updates scattered by all-to-all)
    owners.py         the plan: who owns which matrix, where each rank's piece lies
    muon.py           `Muon`: torch.optim.Muon's updates on sharded parameters
    placement.py      `whole_block_placement`: a shard_placement_fn leaving every rank whole blocks
"""

from .muon import Muon, newton_schulz
from .placement import whole_block_placement
from .whole_matrix import WholeMatrixOptimizer, local

__all__ = ["Muon", "WholeMatrixOptimizer", "local", "newton_schulz", "whole_block_placement"]
