"""Tracing a function into a tape and running it: the interpreter, checkpoint segments,
rebuilds, the fused path.

Private: the public API is `tapegrad`'s own namespace (docs/architecture.md)."""
