"""The memory tier: a host's copy of each saved step in tmpfs (slabs), what peers push and
read, what a restore maps. See README.md beside this file.
"""
