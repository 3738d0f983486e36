"""The one error type of data preparation and loading."""

from __future__ import annotations


class DataError(ValueError):
    """Data that cannot be prepared or loaded; the message names the file or column and the fix."""
