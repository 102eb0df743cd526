"""Operator tools behind the `jaxckpt` command: offline views of a checkpoint.

`_catalog` (what a checkpoint directory and memory roots hold), `_inspect`,
`_verify`, `_advise` (checkpoint intervals from measured costs), `_table`
(rendering tables and units).
"""
