"""Per-arch facts the variants use (descriptor and swizzle math)."""
