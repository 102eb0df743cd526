"""The restore path: reading verified chunks into the target's shardings, and reading
checkpoints other loops wrote. See README.md beside this file.
"""
