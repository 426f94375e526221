"""Training the small K3 of the accuracy table (docs/ACCURACY.md): tasks.py (data), net.py (the
differentiable forward), kda_chunk.py (chunked KDA), loop.py (the run), export.py (the checkpoint)."""
