"""The bottom layer: the tape's data, the residual-policy protocol, caches, and the one
module that touches jax's internals.

Private: the public API is `tapegrad`'s own namespace (docs/architecture.md)."""
