"""The build pipeline: render or CuTe source -> NVRTC/CuTe compile -> inspect -> store. Never imports k3gen.runtime."""
