"""Runs that keep themselves productive: the in-step spike guard, rewind-and-skip with step
replay, the goodput ledger, the hang watchdog and the fault-injection lab.

The guide: docs/resilience.md.
"""
