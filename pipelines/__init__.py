"""Composes models, compress and upcycle: commands/ (one per `remodel` command) over training/ over data/ over distributed/ (import-linter keeps that order)."""
