"""Runtime processes: the ``Runtime`` protocol, its registry and the model definitions."""
