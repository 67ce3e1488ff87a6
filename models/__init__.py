"""Describers: model config + training setup in, operation graph out (never memory totals)."""
