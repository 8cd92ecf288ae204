// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// `inproc::Memory`: where the payloads of an in-process world live and how they are copied. The
/// default is host memory and std::memcpy; a world whose ranks share a GPU copies with the CUDA
/// runtime instead (kernels/seqpar/gpu/device_world.hpp), so that device buffers can be sent.
///
/// @code
/// seqpar::backend::inproc::World world(4, {.memory = my_memory});  // every payload copy goes through it
/// @endcode

#include <cstddef>
#include <cstring>
#include <new>

namespace seqpar::backend::inproc {

/// Copies and buffers of an in-process world, as plain function pointers (the world's cost on the
/// host stays one indirect call per copy). Every byte a transport moves goes through `copy`: a
/// collective's blocks out of its peers' buffers, a send's payload into the receiver's mailbox, a
/// receive's payload out of it.
struct Memory {
  /// Copies `bytes` (> 0) bytes; the ranges do not overlap. May return before the copy is done if
  /// `fence` waits for it.
  using Copy = void (*)(std::byte* to, const std::byte* from, std::size_t bytes);
  /// Completes the copies the calling thread has issued.
  using Fence = void (*)();
  /// Memory of a mailbox buffer (eager sends keep their payload there until it is received).
  using Allocate = void* (*)(std::size_t bytes);
  using Release = void (*)(void* p) noexcept;

  static void host_copy(std::byte* to, const std::byte* from, std::size_t bytes) noexcept {
    std::memcpy(to, from, bytes);
  }
  static void* host_allocate(std::size_t bytes) { return ::operator new(bytes); }
  static void host_release(void* p) noexcept { ::operator delete(p); }

  Copy copy = &host_copy;
  /// Called after the copies of one operation, before their data is handed on (a message published
  /// to its receiver, a receive returning, a collective's ranks leaving); null: copies are synchronous.
  Fence fence = nullptr;
  Allocate allocate = &host_allocate;
  Release release = &host_release;

  /// Waits for the copies issued so far (a no-op for synchronous copies).
  void finish() const {
    if (fence != nullptr) fence();
  }
};

}  // namespace seqpar::backend::inproc
