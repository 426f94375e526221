// Programmatic dependent launch (sm_90+), for kernels whose launcher may set the PDL attribute.
// Both are no-ops unless the launch carries it. launch_dependents lets the next kernel on the
// stream start its own prologue once every CTA of this grid has issued it; wait blocks until the
// previous kernel has completed and its writes are visible, so every read of data another kernel
// may write (activations, slots, state pools, outputs it may still read) must follow it.
//
// What a prologue may still do with such data: warm L2. L2 is the GPU's point of coherence, so a
// prefetch into it can never make a later load see stale bytes (a write by the previous kernel
// lands in L2 over the prefetched line), and the addresses may come from a hint read that races
// with that kernel: a stale hint only wastes the prefetch.
#pragma once

namespace k3gen {

__device__ __forceinline__ void griddep_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}
__device__ __forceinline__ void griddep_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }

// A read that may race with the previous kernel's write of the same word (relaxed, so defined
// under the PTX memory model; L1 is bypassed): only for choosing addresses to prefetch.
__device__ __forceinline__ int hint_load(const int* p) {
  int v;
  asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Bring [p, p + bytes) into L2 (p 16-byte aligned, bytes a multiple of 16): one instruction for
// a whole contiguous block, no registers or shared memory held.
__device__ __forceinline__ void l2_prefetch_bulk(const void* p, unsigned bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"(bytes) : "memory");
}

__device__ __forceinline__ void l2_prefetch_line(const void* p) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p) : "memory");
}

}  // namespace k3gen
