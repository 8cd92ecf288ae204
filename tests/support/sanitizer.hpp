// SPDX-License-Identifier: Apache-2.0
// Whether this test executable is built with a sanitizer (CI's ASan + UBSan and TSan runs). The exhaustive
// numeric sweeps run in full in the Release build; under a sanitizer, whose job is memory errors and races
// rather than coverage, they run a representative subset (TSan makes them ~20x slower): the strategy sweeps
// on tests/support/strategy_list.hpp's sanitizer sweep, chosen at compile time (the instantiations were
// most of the sanitizer builds' compile time), a few loops at run time.
#pragma once

namespace seqpar::test {
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
inline constexpr bool kUnderSanitizer = true;
#else
inline constexpr bool kUnderSanitizer = false;
#endif
}  // namespace seqpar::test
