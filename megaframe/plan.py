"""Dry-run planner: per-rank memory and the pipeline bubble of a layout, without any process group.

    python -m megaframe.plan [hydra overrides] +world_size=N [+device_memory_gb=X] [+plan_json=PATH]
                             [+device=H100|H100_500W|H200|A100|B200|cpu | +device_profile=PATH]

The config is composed and validated as train.py does (megaframe.config.load_config; prepared data
is not read, since planning happens before it exists), so a layout train.py would refuse exits 2 with
the same one-line message. `+world_size` (required unless $WORLD_SIZE is set), `+device_memory_gb`
(GiB per device) and `+plan_json` are the planner's own and are removed before composing. Every
rank's model is then built on the meta device with a virtual mesh (megaframe.planning.memory.rank_plan).
A rank over the device memory prints a `DOES NOT FIT` line (exit code 0: the plan itself worked).
The layout's step time, tokens/s per device and MFU on the device (the step-time model of
planning.steptime.timing) follow; `+plan_json` has them as step_time_s, tokens_per_s_per_device, mfu,
peak_bytes and fits.

    python -m megaframe.plan calibrate [--out PATH] [--quick]

measures GEMM, attention and collective throughput on the present device and writes a device profile
(megaframe.planning.calibrate) that `+device_profile=PATH` uses in place of a `+device` table entry.

    python -m megaframe.plan model=llama3_8b +world_size=64 +device_memory_gb=80 +search=true
                             [+device=H100|H100_500W|H200|A100|B200|cpu] [+top=5] [+efficiency=0.5]
                             [+measure=K [+measure_steps=6]]

proposes a layout instead: every valid (tp, cp, pp, vpp, dp, ep, ZeRO stage, HSDP shard group, grad reduce
dtype, micro-batch, recompute) is sized in every phase (start-up, step, save, load), those with a phase over
the memory dropped, the rest ranked by the step-time model of planning.search.rank (device figures and
their sources in megaframe.planning.devices); the top ones are printed with their memory per phase and why
each is slower than the first, and the layouts within the model's measured error of #1 are called ties.
Progress goes to stderr; `+plan_json=PATH` writes every ranked layout. The model, data and batch settings
come from the config. `+measure=K` then trains each of the top K layouts for +measure_steps steps on this
machine (torchrun, world_size local processes, a temporary run folder: planning/measure.py) and prints the
measured ranking beside the predicted one.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

from megaframe.config.keys import PLANNER_KEYS as OWN_KEYS
from megaframe.config.keys import take_tool_keys
from megaframe.config.rules import FIELD_RULES, NONNEG, POS, POSF, SHARE, Rule, check_options
from megaframe.errors import fail, write_refused
from megaframe.planning.answer import layout_timing, timing_line
from megaframe.planning.measure import WARMUP_ROWS
from megaframe.planning.render import render
from megaframe.planning.search.report import human, search_report


def split_args(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """Hydra overrides and the planner's own `+key=value` settings (also accepted without the +)."""
    own, overrides = take_tool_keys(argv, OWN_KEYS)
    return overrides, own


MAX_MEASURE_STEPS = 1000
"""+measure_steps' upper bound: each measured layout trains under a 600 s timeout (planning.measure), so a
larger count only times out every layout after ten minutes each."""

SETTING_RULES = {
    "world_size": POS,
    "device_memory_gb": POSF,
    "efficiency": SHARE,
    "top": POS,
    "link_timeout_s": FIELD_RULES["train.dist_timeout_s"],  # a timeout, as the config's timeouts
    "measure": NONNEG,
    # a timed step after the warm-up ones
    "measure_steps": Rule(WARMUP_ROWS + 1, hi=MAX_MEASURE_STEPS, hi_open=False, integer=True),
}
"""The planner's own numeric +key=value settings, by config/rules.py's rules."""


def check_settings(own: dict[str, str]) -> dict:
    """The planner's own +key=value settings, each in its range before any work (a nan memory, an
    efficiency of 0 or an unwritable +plan_json were tracebacks, the last after the whole plan): `own` with
    its numbers parsed (SETTING_RULES); ValueError names the setting and what was typed."""
    own = check_options(own, SETTING_RULES, lambda key, value: f"+{key}={value}")
    if own.get("search", "false").lower() not in ("true", "1", "yes", "false", "0", "no"):
        raise ValueError(f"+search={own['search']} must be true or false")
    if "device_profile" in own and not Path(own["device_profile"]).is_file():
        raise ValueError(f"+device_profile={own['device_profile']}: no such file")
    if int(own.get("measure", 0)) and own.get("search", "false").lower() not in ("true", "1", "yes"):
        raise ValueError(f"+measure={own['measure']} measures the search's top layouts: add +search=true")
    if "plan_json" in own:
        out = Path(own["plan_json"])
        if out.is_dir() or not out.parent.is_dir() or not os.access(out.parent, os.W_OK):
            raise ValueError(f"+plan_json={own['plan_json']}: not a file in a writable folder")
    return own


def main(argv: list[str]) -> int:
    from megaframe.config import ConfigError, load_config

    if "--help" in argv or "-h" in argv:
        print(__doc__.strip())
        return 0
    if argv[:1] == ["calibrate"]:
        from megaframe.planning.calibrate import main as calibrate

        return calibrate(argv[1:])
    overrides, own = split_args(argv)
    try:
        own = check_settings(own)
        world = int(own["world_size"]) if "world_size" in own else None
        memory = float(own["device_memory_gb"]) if "device_memory_gb" in own else None
        world = world or int(os.environ.get("WORLD_SIZE", "0"))  # planning inside a launched job
        if world < 1:
            raise ValueError("+world_size=N (the number of ranks to plan for) is required")
        searching = own.get("search", "false").lower() in ("true", "1", "yes")
        # a search picks the layout itself: the config is checked as one rank's, each candidate on `world`
        cfg = load_config(overrides, world_size=1 if searching else world, check_data=False)
    except ValueError as e:  # ConfigError is a ValueError; so is a bad +world_size
        return fail(e if isinstance(e, ConfigError) else f"plan settings: {e}")
    if searching:
        return search_main(cfg, world, memory, own, overrides)
    from megaframe.planning.memory.block_memory import on_host
    from megaframe.planning.memory.rank_plan import plan_layout

    per_rank = -(-cfg.model.num_layers // cfg.parallel.pp)
    if per_rank > MAX_LAYERS_PER_RANK:  # bounded: a plan that would run for minutes is refused in a second
        return fail(
            f"model.num_layers={cfg.model.num_layers} is {per_rank} layers per pipeline rank: the planner "
            f"sizes each on the meta device and plans at most {MAX_LAYERS_PER_RANK} per rank (about a "
            "minute); plan with more parallel.pp, or +search=true (it sizes one layer and scales)"
        )
    try:
        dev = pick_device(own)
    except ValueError as e:
        return fail(f"plan settings: {e}")
    if memory is None and ("device" in own or "device_profile" in own) and dev.memory_gb:
        memory = dev.memory_gb  # a device named alone: fits is judged against its own memory
    cfg = for_device(cfg, dev)
    with still_planning(f"{cfg.model.name} on {world} rank(s)"):
        plan = plan_layout(cfg, world, memory, 0.0 if on_host(cfg) else dev.alloc_headroom)
        try:
            timing = layout_timing(cfg, world, dev, plan)
        except ConfigError as e:  # a layout the device's nodes cannot hold as set (dispatch by node)
            return fail(e)
    print(render(plan, cfg), flush=True)
    print(timing_line(timing), flush=True)
    if dev.alloc_headroom:  # what torch.cuda.max_memory_reserved would read (torchtitan's memory figure)
        print(
            f"reserved on {dev.name}: {human(timing['reserved_bytes'])} (the largest phase "
            f"{human(timing['peak_bytes'])} + allocator headroom {100 * dev.alloc_headroom:.0f} %: "
            "planning/devices.py)",
            flush=True,
        )
    return write_plan_json(own, {**plan.to_dict(), **timing})


def pick_device(own: dict):
    """+device_profile=PATH (a calibrated profile) or +device=NAME (default H100), +efficiency over it, and
    +device_memory_gb as its memory: every line then names one device, the one judged (a plan that fit
    16 GiB said "step time on H100 SXM5 80GB" beside it)."""
    from megaframe.planning.devices import get_device, load_profile

    eff = own.get("efficiency")
    if "device_profile" in own:
        dev = load_profile(own["device_profile"], efficiency=eff)
    else:
        dev = get_device(own.get("device", "H100"), float(own.get("link_timeout_s", 120)), efficiency=eff)
    if "device_memory_gb" not in own:
        return dev
    gb = own["device_memory_gb"]
    return replace(dev, name=f"{dev.name} with {gb:g} GiB (+device_memory_gb)", memory_gb=gb)


def for_device(cfg, dev):
    """The config as it runs on the planned device: train.device=auto resolves to cuda on a GPU (+device),
    so the plan counts that GPU's kernels (planning.memory.block_memory.gpu_kernels), not this host's."""
    if str(cfg.train.device) != "auto" or dev.name.startswith("cpu"):
        return cfg
    return replace(cfg, train=replace(cfg.train, device="cuda"))


def search_main(cfg, world: int, memory_gb: float | None, own: dict, overrides: list[str] = ()) -> int:
    from megaframe.planning.search.rank import MODEL_ERROR, search, ties

    try:
        dev = pick_device(own)
        top = int(own.get("top", 5))
    except ValueError as e:
        return fail(f"plan settings: {e}")
    cap = memory_gb * 2**30 if memory_gb is not None else None
    cfg = for_device(cfg, dev)
    try:
        ests, n, dropped = search(
            cfg, world, dev, cap, progress=lambda text: print(text, file=sys.stderr, flush=True)
        )
    except KeyboardInterrupt:
        interrupted()
    print(search_report(cfg, world, dev, ests, n, dropped, top, cap))
    # every fitting layout, ranked, with its phases and parts
    written = write_plan_json(
        own,
        {
            "world_size": world,
            "device": dev.name,
            "candidates": n,
            "dropped_for_memory": dropped,
            "ties_with_first": ties(ests),
            "model_error": MODEL_ERROR,
            "ranked": [e.to_dict() for e in ests],
        },
    )

    if written:
        return written
    k = int(own.get("measure", 0))
    if k and ests:
        from megaframe.planning import measure

        steps = int(own.get("measure_steps", 6))
        rows = measure.measure(
            cfg,
            list(overrides),
            ests,
            k,
            world,
            steps,
            progress=lambda text: print(text, file=sys.stderr, flush=True),
        )
        print(measure.report(rows, steps), flush=True)
    return 0


def interrupted():
    """Ctrl-C during a search: one line and exit 130 (the shell's code for SIGINT) at once. os._exit skips
    the interpreter's teardown, which freed the search's millions of objects for about a minute of CPU
    after the traceback; the search has written nothing and holds no child process."""
    print("megaframe: plan: search interrupted (Ctrl-C); nothing written", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(130)


MAX_LAYERS_PER_RANK = 1024
"""The largest preset has 126 layers; the meta sizing costs ~30 ms per layer on a busy 2-core machine."""
PROGRESS_EVERY_S = 15.0
"""A plan that takes longer says so on stderr this often: a silent command looks hung."""


@contextlib.contextmanager
def still_planning(what: str, every_s: float = PROGRESS_EVERY_S):
    """While the body runs, `plan: still sizing WHAT (N s)` on stderr every `every_s` seconds."""
    import threading
    import time

    done, t0 = threading.Event(), time.monotonic()

    def tell():
        while not done.wait(every_s):
            print(f"plan: still sizing {what} ({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)

    thread = threading.Thread(target=tell, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def write_plan_json(own: dict, data: dict) -> int:
    """+plan_json=P: the plan as JSON; a write that fails is one line: exit 1 for a full disk (/dev/full,
    ulimit -f, a read-only mount: as every tool, docs/checkpoints.md), 2 for a path that cannot be one."""
    if "plan_json" not in own:
        return 0
    try:
        Path(own["plan_json"]).write_text(json.dumps(data, indent=1))
    except OSError as e:
        code = 1 if write_refused(e) else 2
        return fail(f"+plan_json={own['plan_json']}: cannot write the plan ({e})", code=code)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
