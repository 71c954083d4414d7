"""Mixture of experts: router (router.py), expert-parallel dispatch (dispatcher.py), the MoE MLP
(layer.py) and its per-step statistics, expert-bias update and metrics (stats.py)."""

from megaframe.model.moe.layer import MoE

__all__ = ["MoE"]
