"""The save path: the snapshot (the stall), one save's background half, and what a
handler's saves leave running. See README.md beside this file.
"""
