"""CuTe DSL kernels, one module per op (imported only by the compile worker: they import cutlass)."""
