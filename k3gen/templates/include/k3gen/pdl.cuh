// Programmatic dependent launch (sm_90+), for kernels whose launcher may set the PDL attribute.
// Both are no-ops unless the launch carries it. launch_dependents lets the next kernel on the
// stream start its own prologue once every CTA of this grid has issued it; wait blocks until the
// previous kernel has completed and its writes are visible, so every read of data another kernel
// may write (activations, slots, state pools, outputs it may still read) must follow it.
#pragma once

namespace k3gen {

__device__ __forceinline__ void griddep_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}
__device__ __forceinline__ void griddep_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }

}  // namespace k3gen
