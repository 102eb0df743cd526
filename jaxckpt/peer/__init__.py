"""The peer data service: how a process's memory-tier parts reach other hosts.

Layers, bottom up: `_wire` (the protocol: addresses, headers, names), `_client`
(fetch, range reads, streaming push), `_push_receiver` (a pushed part received,
verified and committed), `_request_handler` (one HTTP request against a memory
tier), `_server` (the threaded server a process runs), `_peers` (a run's peers:
exchange addresses, push replicas, read from holders).
"""
