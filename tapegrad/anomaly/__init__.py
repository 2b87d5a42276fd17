"""Anomaly mode: the finite-value probes, the observer the interpreter calls, messages and the log.

Private: the public API is `tapegrad`'s own namespace (docs/architecture.md)."""
