"""Drafters: every kind of draft behind one interface (see base.Drafter)."""

from .base import Draft, Drafter, DraftParams

__all__ = ["Draft", "DraftParams", "Drafter"]
