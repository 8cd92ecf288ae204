// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
// The one place an instruction set becomes a tile policy: CpuFlash's calls and bench/attention_cpu's micro-kernel
// rows both run `f.template operator()<Tiles>()` through it.
#pragma once

#include "seqpar/attention/cpu_isa.hpp"
#include "seqpar/attention/detail/flash_tiles.hpp"
#include "seqpar/attention/detail/flash_tiles_avx2.hpp"
#include "seqpar/attention/detail/flash_tiles_avx512.hpp"
#include "seqpar/attention/detail/flash_tiles_avx512bf16.hpp"

#include <type_traits>

namespace seqpar::attention::detail {

/// f.template operator()<Tiles>() with the policy of `isa` for accumulation type A and storage type T: the AVX-512
/// (with bf16 dot products for bf16 storage) or AVX2 tiles for float accumulation (where this build has the
/// dispatch), the portable ones otherwise (double; kPortable; kAuto is resolved by the caller, resolve_cpu_isa).
/// The bf16 policy is instantiated for bf16 storage only (float storage never runs it: resolve_cpu_isa).
template <class A, class T = A, class F>
decltype(auto) with_tile_policy(CpuIsa isa, F&& f) {
#if SEQPAR_CPU_DISPATCH
  if constexpr (std::is_same_v<A, float>) {
    if constexpr (std::is_same_v<T, bf16>) {
      if (isa == CpuIsa::kAvx512Bf16) return f.template operator()<avx512bf16::Avx512Bf16Tiles>();
    }
    if (isa == CpuIsa::kAvx512) return f.template operator()<avx512::Avx512Tiles>();
    if (isa == CpuIsa::kAvx2) return f.template operator()<avx2::Avx2Tiles>();
  }
#else
  (void)isa;
#endif
  return f.template operator()<PortableTiles<A>>();
}

}  // namespace seqpar::attention::detail
