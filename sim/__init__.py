"""The discrete-event simulator: replays traces against the same policy objects as the engine."""
