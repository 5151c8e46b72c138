"""Geometry: placements, meshes, per-rank layouts and hand-cut chunks as pure functions of shapes.

May import: ``shardviz.errors`` and this folder. No torch, no numpy arrays of anyone's tensors:
what a rank holds follows from (global shape, mesh shape, placements) alone.
"""
