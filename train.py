"""megaframe entry point: `python train.py [hydra overrides]`, or under torchrun / srun for many ranks.

Bad input (config, data, checkpoint) ends the run with exit code 2 and one line naming the cause,
checked before any process group is built. `--cfg` prints the composed config; `--help` the usage.
"""

import os
import sys


def main(argv: list[str]) -> int:
    # first, before the slow imports: a stop signal (Slurm's --signal, torchrun) during start-up is
    # remembered and honoured at the first step instead of killing the rank mid-rendezvous
    from megaframe.runops.signals import StopFlag

    stop = StopFlag()
    from megaframe.config import ConfigError, load_config
    from megaframe.errors import fail

    quiet = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) != "0"  # one rank speaks for all
    if "--help" in argv or "-h" in argv:
        from megaframe.config.usage import usage

        try:
            print(__doc__.strip() + "\n\n" + usage(), flush=True)
        except BrokenPipeError:  # `train.py --help | head`: the reader left; no traceback for that
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    show = "--cfg" in argv
    argv = [a for a in argv if a != "--cfg"]
    try:
        cfg = load_config(argv)
        check_logging(cfg, show)
    except ConfigError as e:
        if not quiet:
            return fail(e)
        else:  # let rank 0 print before torchrun sees a failed rank and stops everyone
            import time

            time.sleep(3)
        return 2
    if show:
        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
        return 0
    from megaframe.training.trainer import TrainingError, run

    try:
        run(cfg, stop)
    except ConfigError as e:
        return fail(e)
    except TrainingError as e:
        return fail(e, code=1)
    return 0


def check_logging(cfg, show: bool) -> None:
    """logging.wandb.mode=online without credentials, or logging.tensorboard.enabled=true without the
    tensorboard package, is bad input: refused before any rank starts."""
    from megaframe.config import ConfigError
    from megaframe.tracking import tensorboard_problem, wandb_login_problem

    problem = None if show else wandb_login_problem(cfg) or tensorboard_problem(cfg)
    if problem:
        raise ConfigError(problem)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
