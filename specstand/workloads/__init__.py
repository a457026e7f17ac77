"""Agent workloads: the turn/call format, its validation, and importers of public data sets."""

from specstand.workloads.format import Call, Turn, WorkloadError, load_workload, parse_turn, save_workload

__all__ = ["Call", "Turn", "WorkloadError", "load_workload", "parse_turn", "save_workload"]
