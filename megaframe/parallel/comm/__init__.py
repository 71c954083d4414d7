"""Collectives over one mesh axis, plain and autograd-aware, each counting the bytes this rank sends.

Byte counts are the ring-algorithm volumes for n ranks and a tensor of b bytes:
all-reduce 2(n-1)/n·b, all-gather (n-1)·b_in, reduce-scatter (n-1)/n·b_in, all-to-all (n-1)/n·b.
An axis of size 1 never communicates, so every function is the identity there. A virtual axis (the
planner's, no process group) counts and returns tensors of the right shape without communicating.
Every collective is also noted in the axis's CommStats ring buffer as it is entered (op, group,
shape, bytes), which the hang watchdog dumps: the last entries name the collective a rank is stuck in.

Activations are sequence-first ([S, B, D]), so sequence-parallel splits and gathers are along dim 0,
which is contiguous and maps straight onto all_gather / reduce_scatter of flat tensors.

One module per kind: accounting.py (what each notes), plain.py, autograd_ops.py, p2p_batch.py,
objects.py; callers use this package's names (`from megaframe.parallel import comm`).
"""

# the one torch.distributed: tests replace its calls (comm.dist.batch_isend_irecv) for every module here
import torch.distributed as dist  # noqa: F401

from megaframe.parallel.comm.autograd_ops import (  # noqa: F401  (the package's API)
    _eager,
    all_to_all,
    copy_to_tp,
    gather_from_cp,
    gather_from_sp,
    reduce_from_tp,
    reduce_scatter_to_sp,
    scatter_to_sp,
)
from megaframe.parallel.comm.objects import broadcast_object, gather_objects  # noqa: F401
from megaframe.parallel.comm.p2p_batch import batch_isend_irecv  # noqa: F401
from megaframe.parallel.comm.plain import (  # noqa: F401
    all_gather_dim0,
    all_gather_flat,
    all_gather_world,
    all_reduce,
    all_to_all_counts,
    all_to_all_rows,
    reduce_scatter_dim0,
    reduce_scatter_flat,
    split_dim0,
)
