"""How long a layout's step takes: compute by kind of work (compute, moe), each axis's communication and
the bubble (step), the optimizer's update (fixed)."""
