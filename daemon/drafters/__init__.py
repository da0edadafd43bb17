"""Drafters: one module per kind of draft, behind `specd.daemon.spec.drafter.Drafter`, and
the registry that builds them by speculation type (`registry.make_drafter`)."""
