"""Errors the pipeline raises on purpose: each one names the file, the tensor and what to do."""

from __future__ import annotations


class ConversionError(Exception):
    """A conversion cannot go on; the message says why and what to do."""


class SourceError(ConversionError):
    """A source checkpoint file is unreadable, truncated, or lies about its contents."""

    def __init__(self, file: str, message: str, tensor: str | None = None):
        self.file, self.tensor = file, tensor
        self.detail = message
        where = f"{file}: tensor {tensor!r}: " if tensor else f"{file}: "
        super().__init__(where + message)

    def __reduce__(self):  # picklable across worker processes
        return (SourceError, (self.file, self.detail, self.tensor))


class PlanError(ConversionError):
    """The metadata-only validation pass found problems (listed one per line)."""

    def __init__(self, problems: list[str], limit: int = 25):
        self.problems = problems
        shown = problems[:limit]
        more = f"\n  ... and {len(problems) - limit} more" if len(problems) > limit else ""
        head = f"validation failed ({len(problems)} problem{'s' if len(problems) != 1 else ''}):"
        super().__init__("\n  ".join([head, *shown]) + more)

    def __reduce__(self):
        return (PlanError, (self.problems,))


class OutputError(ConversionError):
    """The output folder holds something this command must not touch or mix with."""


class LedgerError(ConversionError):
    """The ledger of a job disagrees with the plan or with the bytes on disk."""
