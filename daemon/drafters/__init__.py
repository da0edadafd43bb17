"""Drafters: every kind of draft behind one interface (see base.Drafter)."""

from specd.daemon.spec.drafter import Draft, Drafter, DraftParams

__all__ = ["Draft", "DraftParams", "Drafter"]
