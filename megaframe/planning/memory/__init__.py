"""How much memory a layout needs: per rank from its built meta-device model (rank_plan) or from the dims
(dims, for the search), by phase (phases), with the activations its schedule holds in flight (inflight)."""
