"""Capture: torch objects and running code turned into plain data.

May import: ``data``, ``geometry``, ``shardviz.errors`` and this folder. ``capture/torch/`` is the
only place in the package that touches private torch.
"""
