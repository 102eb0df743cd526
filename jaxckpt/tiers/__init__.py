"""Where a checkpoint's bytes live: the memory tier (slabs in tmpfs), persistent storage
(zarr3 through tensorstore) and the index of a step's copies. See README.md beside this file.
"""
