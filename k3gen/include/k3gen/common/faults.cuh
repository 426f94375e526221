// The device-side error word: kernels that meet a bad index clamp or skip it and OR the fault's bit
// into their op's 32-bit word (k3gen/runtime/faults.py owns the buffer, reads it, names the bits).
// Nothing here runs on the good path but an integer compare: the atomic is on the fault branch.
// The bit values are mirrored by FAULTS in k3gen/runtime/faults.py (a CPU test compares them).
#pragma once

namespace k3gen {
namespace fault {

enum : unsigned {
  kPage = 1u << 0,      // a block-table entry read is outside [0, num_pages)
  kTable = 1u << 1,     // a position needs a block-table column past the table's width
  kSlot = 1u << 2,      // a state slot outside [0, num_slots) and not -1 (padding)
  kRing = 1u << 3,      // an HP-tail ring slot outside [0, num_slots)
  kLength = 1u << 4,    // a sequence length outside [T, block-table capacity]
  kRows = 1u << 5,      // cu_rows: a row range outside the rows tensor, decreasing, or longer than the grid
  kStart = 1u << 6,     // a start position negative, or start + rows past 2^31
  kPending = 1u << 7,   // a pending-draft count outside [0, M]
  kExpert = 1u << 8,    // an expert id outside [0, route_experts)
  kOffsets = 1u << 9,   // expert offsets outside [0, T k] or decreasing
  kPerm = 1u << 10,     // a permutation entry outside [0, T k)
};

// Runtime-null-checked report (err == nullptr: a launch without an error word).
__device__ __forceinline__ void report(unsigned* err, unsigned bits) {
  if (err != nullptr) atomicOr(err, bits);
}

// Kernels whose Config declares kFaults = true report; a Config without the member (the frozen
// sources of the original target) compiles every report, and the test that feeds it, away.
template <class T> struct VoidOf { using type = void; };
template <class C, class = void> struct On { static constexpr bool value = false; };
template <class C> struct On<C, typename VoidOf<decltype(C::kFaults)>::type> {
  static constexpr bool value = C::kFaults;
};

template <class C>
__device__ __forceinline__ void report(unsigned* err, unsigned bits) {
  if constexpr (On<C>::value) report(err, bits);
}

}  // namespace fault
}  // namespace k3gen
