"""k3gen: a code-generating kernel compiler for the Kimi K3 hybrid (KDA + MLA) model."""
__version__ = "0.1.0"
