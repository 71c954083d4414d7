"""The trainer's own error: the run cannot go on, and it is not the user's input (that is ConfigError,
exit 2). train.py prints it on one line and exits 1."""


class TrainingError(RuntimeError):
    """The run cannot go on (not a bad input): train.py prints it on one line and exits 1."""
