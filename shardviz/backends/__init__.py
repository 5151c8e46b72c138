"""Backends: where SPMD code runs — simulated ranks in this process or real ones elsewhere.

May import: ``capture``, ``data``, ``geometry``, ``shardviz.errors`` and this folder; never a
view or a front end (a picture goes through ``session.draw``, which the front end registered).
``base`` is the interface, ``choose`` picks the current backend, ``session`` holds the state the
backends and the front ends share.
"""
