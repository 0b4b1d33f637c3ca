"""Speculative decoding: drafters propose tokens, a verify group checks them in one window."""

from .speculator import SpecCounters, Speculator, make_speculator

__all__ = ["SpecCounters", "Speculator", "make_speculator"]
