"""The run's configuration, one package: the schema (schema.py, its closed choices in choices.py), loading
(loading.py: compose conf/ with Hydra, adopt settings from outside the command line in adopt.py, validate),
the cross-field checks (checks.py, the per-field table in rules.py) and the override-key rules (keys.py).

`from megaframe.config import Config, load_config` is the public path. The schema modules are leaves every
package reads (megaframe.config.schema); loading sits above the packages whose rules it asks.
"""

from megaframe.config.loading import (  # noqa: F401  (the package's public names)
    CONF_DIR,
    DEFAULT_EXTENSIONS,
    ROOT,
    Activation,
    BlendSource,
    CheckpointConfig,
    Config,
    ConfigError,
    CPComm,
    DataConfig,
    DataKind,
    Device,
    DocSplit,
    LoggingConfig,
    LRSchedule,
    ModelConfig,
    Norm,
    OptimConfig,
    ParallelConfig,
    PositionEmbedding,
    Precision,
    Recompute,
    RouterScore,
    RunConfig,
    SaveErrorPolicy,
    ScheduleKind,
    TrainConfig,
    WandbConfig,
    WandbMode,
    default_run_name,
    load_config,
    plain,
    validate,
)
