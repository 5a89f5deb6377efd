"""porter: training within a memory budget (ZeRO 0-3, activation checkpointing, offload).

The bindings live in the extension porter._porter; docs/python.md is the reference.
"""
from porter._porter import *  # noqa: F401,F403
from porter._porter import __doc__, __version__  # noqa: F401
