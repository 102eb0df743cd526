"""The on-disk format: manifests, chunk grids, checksums, shardings and leaf kinds.

Pure data and arithmetic, no I/O and no other process: see README.md beside this file.
"""
