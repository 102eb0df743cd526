"""Coordination between processes: the jax.distributed exchanges, agreement, placement
and planning. See README.md beside this file.
"""
