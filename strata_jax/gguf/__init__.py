"""Reading GGUF models: split files, tensors memory-mapped in place, ModelSpec from metadata."""

from .errors import (
    GGUFError,
    HeaderLimitError,
    MetadataError,
    MissingSplitPartError,
    MissingTensorError,
    NotGGUFError,
    SplitMismatchError,
    TensorSizeError,
    TruncatedGGUFError,
    UnsupportedArchitectureError,
    UnsupportedTensorTypeError,
)
from .reader import GGUFModel, TensorInfo, read_metadata, split_part_paths
from .spec import EXPERT_TENSOR_KINDS, SUPPORTED_ARCHITECTURES, ModelSpec, RopeScaling

__all__ = [
    "EXPERT_TENSOR_KINDS",
    "SUPPORTED_ARCHITECTURES",
    "GGUFError",
    "GGUFModel",
    "HeaderLimitError",
    "MetadataError",
    "MissingSplitPartError",
    "MissingTensorError",
    "ModelSpec",
    "NotGGUFError",
    "RopeScaling",
    "SplitMismatchError",
    "TensorInfo",
    "TensorSizeError",
    "TruncatedGGUFError",
    "UnsupportedArchitectureError",
    "UnsupportedTensorTypeError",
    "load_tokenizer",
    "read_metadata",
    "split_part_paths",
]


def __getattr__(name: str):
    # The tokenizer module is imported on first use: it pulls in `tokenizers`, which reading weights
    # never needs.
    if name == "load_tokenizer":
        from .tokenizer import load_tokenizer

        return load_tokenizer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
