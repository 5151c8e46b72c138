"""Plain data: traces and their events, files and loading, and every analysis that reads them.

May import: ``geometry``, ``shardviz.errors`` and this folder; never torch (not even lazily), so a
saved trace, a model map built on a rank and a numerics report read the same anywhere.
"""
