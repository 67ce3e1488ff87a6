"""Ledger, peaks, budgets and plots, from any event log (simulated or measured)."""
