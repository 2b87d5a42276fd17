"""Records with bodies: scan, while, cond; their saves and loop schedules (sqrt(T),
nested, revolve).

Private: the public API is `tapegrad`'s own namespace (docs/architecture.md)."""
