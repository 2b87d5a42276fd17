"""The transforms users call (grad, vjp, value_and_grad, trace), Function, hook and gradcheck.

Private: the public API is `tapegrad`'s own namespace (docs/architecture.md)."""
