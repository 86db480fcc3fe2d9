"""The one exception type of checkpoint loading, so that callers (the CLI) can print it without a traceback.

Every message names the file (or directory) and the tensor, key or value that is wrong.
"""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint (config.json, safetensors, index json) that cannot be loaded as it is."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A checkpoint file that does not exist (also a FileNotFoundError, as before)."""
