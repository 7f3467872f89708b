"""The project's exceptions, in one place, so callers can catch one base and print one line."""


class GlmcError(Exception):
    """Base of every error glmc raises on purpose; its message is one line naming the problem."""


class DataNotFoundError(GlmcError):
    """A dataset is missing locally; the message says how to get it."""


class ConfigError(GlmcError):
    """An unknown preset, a width that does not fit, or an inconsistent option."""


class CheckpointError(GlmcError):
    """A checkpoint that is corrupt, not safetensors, or does not match the requested model."""


class SpecError(GlmcError):
    """A state dict that a symmetry spec does not cover exactly once, or two models that differ."""


class DeployError(GlmcError):
    """A SuperLink or SuperNode that would not start or join, or a flwr command that failed; quotes its log."""
