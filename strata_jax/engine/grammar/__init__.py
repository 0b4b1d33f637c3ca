"""Constrained decoding: GBNF and JSON schemas compiled to token masks, off the engine's thread."""
