"""Engines: where admitted requests run (the seed's ``micro`` batches, the ``continuous``
roofline model, and later ``forward`` to real servers). See docs/architecture.md."""
