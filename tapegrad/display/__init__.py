"""Text, HTML and graph views of tapes and reports (registered as the tape's printers).

Private: the public API is `tapegrad`'s own namespace (docs/architecture.md)."""
