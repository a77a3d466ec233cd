"""The trio actors that drive the sans-I/O policies in real time (see DESIGN.md)."""
