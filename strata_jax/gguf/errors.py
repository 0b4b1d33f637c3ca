"""Errors for GGUF files that cannot be used, each naming the file, what is wrong, and what to do.

All are `GGUFError`, a `ValueError`, so callers that only care that a file is bad catch one class.
"""

from __future__ import annotations

from pathlib import Path

from quant_types import UnsupportedQuantType


class GGUFError(ValueError):
    """A GGUF file (or split model) that cannot be used. `path` is the file at fault."""

    def __init__(self, path: str | Path, problem: str, advice: str = ""):
        self.path = Path(path)
        self.problem = problem
        self.advice = advice
        message = f"{self.path}: {problem}"
        if advice:
            message += f". {advice}"
        super().__init__(message)


class NotGGUFError(GGUFError):
    """The file does not start with the GGUF magic, or is a GGUF version or byte order we do not
    read."""


class TruncatedGGUFError(GGUFError):
    """The header is cut short, or tensor data runs past the end of the file."""


class HeaderLimitError(GGUFError):
    """The header claims more than any real GGUF holds: arrays nested too deep, an array, a string,
    the metadata or the tensor count beyond strata-jax's bounds (`header.py` says each one and why),
    or a size that cannot fit in the file at all. Raised before anything that size is built."""


class MissingSplitPartError(GGUFError):
    """A part of a split model (NAME-0000i-of-0000N.gguf) is not there."""


class SplitMismatchError(GGUFError):
    """The parts of a split model disagree with each other (counts, numbering, duplicate
    tensors)."""


class UnsupportedArchitectureError(GGUFError):
    """`general.architecture` names a model family strata-jax does not run."""


class UnsupportedTensorTypeError(GGUFError, UnsupportedQuantType):
    """A tensor is stored in a quant type the kernels do not handle (or one unknown to the gguf
    package)."""


class TensorSizeError(GGUFError):
    """A tensor's bytes do not match its shape: its rows are not whole blocks, its data overlaps the
    next tensor's, or its shape disagrees with the model's metadata."""


class MissingTensorError(GGUFError):
    """A tensor the model family needs is not in the file."""


class MetadataError(GGUFError):
    """A metadata key the model needs is missing or has a value that cannot be right."""
