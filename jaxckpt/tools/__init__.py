"""Operator tools behind the `jaxckpt` command: offline views of a checkpoint.

`_catalog` (what a checkpoint directory and memory roots hold), `_listing` (`ls`),
`_inspect`, `_verify`, `_advise` (checkpoint intervals from measured costs:
`_costs`, `_mtbf`, `_young_daly`), `_table` (rendering tables and units).
"""
