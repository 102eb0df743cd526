"""The persistent tier: steps made durable on a filesystem or an object store as zarr3 arrays
through tensorstore, and the index of a step's copies. See README.md beside this file.
"""
