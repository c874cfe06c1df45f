"""loader_service: the CPU-side data-loading service (workers, dispatcher, REST control plane).

Importing this package is cheap: :mod:`wire.protocol` and :mod:`wire.plan`
need only msgpack and numpy, and the client imports them from here.
"""

__version__ = "0.1.0"
