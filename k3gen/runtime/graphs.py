"""CUDA-graph capture of k3gen launches.

Every launcher is capture-safe (no allocation, no host sync, grids from metadata), so a step is
captured by calling it once on a side stream. The side stream waits for the current stream
first (inputs written eagerly before the capture are visible to the replays' first kernel), and
the current stream waits for the side stream afterwards, so eager work issued after `capture`
is ordered after it as well.
"""
from __future__ import annotations


def capture(fn):
    """Capture `fn()` (launches only) into a new torch.cuda.CUDAGraph and return the graph; the
    kernels run at `graph.replay()`, not during capture."""
    import torch
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    return graph
