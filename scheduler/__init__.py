"""lockstep: the host side of Mixture-of-Experts LLM serving.

The scheduler core (``lockstep.policy``) is sans-I/O; the trio engine (``lockstep.engine``)
and the discrete-event simulator (``lockstep.sim``) both drive the same policy objects.
"""

__version__ = "0.1.0"
