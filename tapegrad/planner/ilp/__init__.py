"""The exact (HiGHS) models of the planner: mechanisms, and the joint model's columns,
rows and solve.

Private: the public API is `tapegrad`'s own namespace (docs/architecture.md)."""
