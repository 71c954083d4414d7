"""Picklable objects between the ranks of a job (start-up, resume and checkpoint decisions, never in a
step): rank 0's to every rank, every rank's to every rank."""

from __future__ import annotations

import torch.distributed as dist


def broadcast_object(obj, mesh=None):
    """Broadcast a picklable object from the job's first rank to all of its ranks (start-up, resume and
    checkpoint decisions, never in a step). With `mesh`, over the mesh's world group: a job may run on a
    subset of the processes (the test pool), and only its ranks take part."""
    # Every rank of the job must reach this call (it blocks until all do); one process needs no exchange.
    if not dist.is_initialized() or dist.get_world_size() == 1 or (mesh is not None and mesh.world == 1):
        return obj
    box = [obj]
    if mesh is None:
        dist.broadcast_object_list(box, src=0)
    else:
        # group_src is the rank within the job's group: with the test pool, global rank 0 may not be in it.
        dist.broadcast_object_list(box, group=mesh.group, group_src=0)
    return box[0]


def gather_objects(obj, group) -> list:
    """Every rank's picklable `obj`, in rank order, over the whole-mesh `group` (None: one process).
    Used where ranks must agree on an outcome (a checkpoint commit, a load), never in a step."""
    if group is None:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
