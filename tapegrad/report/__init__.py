"""memory_report, jax_residuals and compare: what backward holds, measured and explained.

Private: the public API is `tapegrad`'s own namespace (docs/architecture.md)."""
