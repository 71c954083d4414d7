"""Start-up straight into shards: build_model creates the params on meta and materialises each rank's
slice in train.precision (ZeRO-3 at dp > 1: not at all; the optimizer materialises the owned segments),
with the init values of before, and the set-up's peak tensor bytes per rank follow the rank's share.
A rank of a dp4 layout is built here in one process on a virtual mesh (nothing in set-up communicates)."""

from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from megaframe.layers.shard import full_init_param
from megaframe.optim.build import build_optimizer
from megaframe.optim.zero3 import Zero3Optimizer
from megaframe.parallel.virtual import virtual_mesh
from tests.distributed.cases import tiny_config
from tests.forms import build_model

MODEL = ["model.num_layers=4", "model.hidden_size=128", "model.ffn_hidden_size=256", "model.vocab_size=512"]


class PeakBytes(TorchDispatchMode):
    """The most bytes of tensor storage alive at once, over the storages the ops inside create (CPU).
    Storages are tracked by weak reference to the storage itself (not to a Python tensor: a param's
    tensor is swapped in place, and ZeRO-3 frees and regrows storages with resize_, outside any op);
    the total is re-read whenever an op's output sits in a storage that is new or changed size."""

    def __enter__(self):
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        changed = False
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                s = t.untyped_storage()
                if self.live.get(s._cdata, (None, -1))[1] != s.nbytes():
                    self.live[s._cdata] = (StorageWeakRef(s), s.nbytes())
                    changed = True
        if changed:
            self.peak = max(self.peak, self.alive())
        return out

    def alive(self) -> int:
        total = 0
        for key, (ref, _) in list(self.live.items()):
            if ref.expired():
                del self.live[key]
                continue
            total += held_bytes(torch.UntypedStorage._new_with_weak_ptr(ref.cdata))
        return total


def held_bytes(s: torch.UntypedStorage) -> int:
    """A storage's bytes, 0 for one with no memory yet (ZeRO's lazy grads and moments: buffer.lazy_zeros)."""
    try:
        return s.nbytes() if s.data_ptr() else 0
    except RuntimeError:  # torch refuses to read a null data pointer
        return 0


def set_up(overrides: list[str], dp: int, dp_rank: int = 0):
    """build_model + build_optimizer for one rank of a dp layout; (model, optimizer, peak bytes)."""
    cfg = tiny_config(MODEL + overrides, dp)
    mesh = virtual_mesh(1, 1, dp, dp_rank=dp_rank, device="cpu")
    with PeakBytes() as m:
        model = build_model(cfg, mesh)
        optimizer = build_optimizer(model, cfg.optim, mesh)
    return cfg, model, optimizer, m.peak


@pytest.mark.parametrize("precision,zero", [("fp32", 0), ("bf16", 1)])
def test_build_model_materialises_in_the_runs_dtype(precision, zero):
    cfg = tiny_config(MODEL + [f"train.precision={precision}", f"optim.zero={zero}"], 1)
    model = build_model(cfg, virtual_mesh(1, 1, 1, device="cpu"))
    want = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    for name, p in model.named_parameters():
        assert p.device.type == "cpu" and p.dtype == want, (name, p.device, p.dtype)
        # the values of before: fp32 init (seed, global name, position), then cast
        assert torch.equal(
            p.detach(),
            full_init_param(
                name, p.placement.shard, cfg.train.seed, cfg.model.init_std, cfg.model.num_layers
            ).to(want),
        )


def test_zero3_leaves_params_on_meta_and_materialises_the_owned_segments():
    """build_model at zero=3 dp4: every param on meta; the optimizer gives each its (freed) storage and
    the master of each owned segment the init value, cast through the params' dtype as before."""
    cfg = tiny_config(MODEL + ["optim.zero=3", "train.precision=bf16"], 4)
    model = build_model(cfg, virtual_mesh(1, 1, 4, dp_rank=1, device="cpu"))
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in model.parameters())
    optimizer = Zero3Optimizer(model, cfg.optim, virtual_mesh(1, 1, 4, dp_rank=1, device="cpu"))
    for name, p in model.named_parameters():
        assert not p.is_meta and p.untyped_storage().nbytes() == 0, name  # gathered at its first use
        full = full_init_param(
            name, p.placement.shard, cfg.train.seed, cfg.model.init_std, cfg.model.num_layers
        )
        for lo, n, views in optimizer.state_segments(p):
            assert torch.equal(views["master"], full.reshape(-1)[lo : lo + n].bfloat16().float()), name


def test_zero3_set_up_peak_follows_the_share():
    """Peak tensor bytes of one rank's build_model + build_optimizer at zero=3: the state the rank keeps
    (1/dp of the fp32 master: grads and moments are made at the first zero_grad) plus a bounded transient
    (one bucket, the init draws), so dp4 needs little more than half of dp2. Before, every rank built its
    whole local model first (fp32), then the whole param buffer, then each bucket's copy: 3·4N bytes before
    any sharding."""
    peaks = {}
    for dp in (2, 4):
        _, model, optimizer, peaks[dp] = set_up(["optim.zero=3"], dp)
        mem = optimizer.memory_bytes()
        kept = mem["mem/params_bytes"] + mem["mem/grads_bytes"] + mem["mem/optim_bytes"]
        bucket = max(4 * b.numel for buf in optimizer.buffers for b in buf.buckets)
        assert kept <= peaks[dp] <= kept + bucket, (dp, peaks[dp], kept, bucket)
    # one process starts with its fp32 params only (4 bytes a param): a dp4 rank its share and the transient
    one = 4 * sum(p.numel() for p in model.parameters())
    assert peaks[4] <= 0.6 * peaks[2] and peaks[4] <= 0.35 * one, (peaks, one)
