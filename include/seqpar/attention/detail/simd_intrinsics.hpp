// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
// <immintrin.h> for CpuFlash's AVX2 and AVX-512 tiles. GCC and Clang declare every intrinsic whatever the
// build's -march (each carries its own target attribute), so the tiles compile in target regions
// (flash_tiles_avx2.hpp, flash_tiles_avx512.hpp) and run only where the CPU has them.
#pragma once

// GCC 12 reports -Wmaybe-uninitialized inside the AVX-512 intrinsics (their _mm512_undefined_ps(),
// GCC PR105593, fixed in GCC 13); the diagnostic is located in the intrinsic headers, so silence it there.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

/// Inlined into its caller, which must be compiled for the same instruction set (a function of the same
/// target region).
#define SEQPAR_ALWAYS_INLINE inline __attribute__((always_inline))
