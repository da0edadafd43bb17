"""The one error `specd convert-draft` reports: a checkpoint or target it cannot convert."""

from __future__ import annotations


class ConvertError(ValueError):
    """A checkpoint that cannot be converted, or does not fit its target; the message names
    the file and the key or tensor at fault, in one line."""
