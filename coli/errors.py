"""Exception types shared across the package. Every message names the culprit (file, tensor, field)
and, where there is one, the setting to change."""


class ColiError(Exception):
    """Base of all errors the CLI reports as a clean one-line message (exit code 2)."""


class ConfigError(ColiError):
    """config.json is missing, unreadable, of another model type, or inconsistent."""


class WeightError(ColiError):
    """A checkpoint tensor is missing, mis-shaped, of an unsupported dtype, or its file is damaged."""
