// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// `attention::CpuIsa`: the instruction sets CpuFlash's micro-kernels exist for, what this CPU supports
/// (read once at run time, as ATen's CPU capability and oneDNN's dispatch do), and how a user forces one.
///
/// A header-only library cannot rely on its users' `-march`: the AVX2 and AVX-512 micro-kernels are compiled
/// with per-function target attributes whatever the build's flags, and CpuFlash picks the best one the CPU
/// (and its OS, for the AVX-512 register state) supports when it is constructed. An explicit choice comes
/// from `CpuFlashArguments::isa`, else from the environment variable `SEQPAR_CPU_ISA` (auto, portable, avx2,
/// avx512, avx512bf16); one the CPU cannot run is refused by name. avx512bf16 (bf16 dot products, `vdpbf16ps`)
/// is for bf16 storage: auto picks it for CpuFlash<bf16> on CPUs with AVX512-BF16; `args.isa` names it for
/// bf16 storage only (float storage is refused: its tiles are fp32), and the process-wide environment variable
/// means the AVX-512 fp32 tiles for float storage.
///
/// @code
/// attention::CpuFlash<float> flash({.threads = 2});             // AVX-512 on an AVX-512 machine, else AVX2 ...
/// attention::CpuFlash<float> avx2({.isa = attention::CpuIsa::kAvx2});   // the AVX2 path, forced
/// std::printf("%s\n", attention::to_string(flash.isa()));
/// @endcode

#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>

#include "seqpar/core/error.hpp"

// The run-time dispatch needs GCC's or Clang's target attributes and an x86-64 target. NVCC's front end
// (a CUDA translation unit including CpuFlash) gets the portable path only.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(__CUDACC__) && \
    !defined(SEQPAR_NO_CPU_DISPATCH)
#define SEQPAR_CPU_DISPATCH 1
#else
#define SEQPAR_CPU_DISPATCH 0
#endif

namespace seqpar::attention {

/// CpuFlash's micro-kernel families. kAuto: the best this CPU supports (or `SEQPAR_CPU_ISA`).
enum class CpuIsa {
  kAuto,
  kPortable,  ///< plain C++, auto-vectorised for the build's -march; any CPU, and double
  kAvx2,      ///< AVX2 + FMA: 8-lane fp32 tiles (6 x 16 register blocks)
  kAvx512,    ///< AVX-512 F/BW/DQ/VL: 16-lane fp32 tiles (6 x 64 register blocks)
  ///   /// AVX-512 plus AVX512-BF16 (bf16 storage only): every tile product by bf16 dot products (vdpbf16ps, two
  /// products per fp32 lane; P and dS rounded to bf16 first, as FlashAttention does), the row steps as kAvx512
  kAvx512Bf16,
};

[[nodiscard]] constexpr const char* to_string(CpuIsa isa) noexcept {
  switch (isa) {
    case CpuIsa::kAuto:
      return "auto";
    case CpuIsa::kPortable:
      return "portable";
    case CpuIsa::kAvx2:
      return "avx2";
    case CpuIsa::kAvx512:
      return "avx512";
    case CpuIsa::kAvx512Bf16:
      return "avx512bf16";
  }
  return "?";
}

/// The name `to_string` gives, or nullopt.
[[nodiscard]] inline std::optional<CpuIsa> parse_cpu_isa(std::string_view name) noexcept {
  for (CpuIsa isa : {CpuIsa::kAuto, CpuIsa::kPortable, CpuIsa::kAvx2, CpuIsa::kAvx512, CpuIsa::kAvx512Bf16})
    if (name == to_string(isa)) return isa;
  return std::nullopt;
}

/// What this CPU and its OS support, as far as CpuFlash cares. Read with cpuid (and xgetbv for the OS's
/// register state) by the compiler's `__builtin_cpu_supports`.
struct CpuFeatures {
  bool avx2_fma = false;
  bool avx512 = false;       ///< F, BW, DQ and VL: what the AVX-512 tiles use
  bool avx512_bf16 = false;  ///< vdpbf16ps and vcvtne2ps2bf16 (with `avx512`): the kAvx512Bf16 tiles

  [[nodiscard]] bool supports(CpuIsa isa) const noexcept {
    switch (isa) {
      case CpuIsa::kAvx512Bf16:
        return avx512 && avx512_bf16;
      case CpuIsa::kAvx512:
        return avx512;
      case CpuIsa::kAvx2:
        return avx2_fma;
      default:
        return true;
    }
  }
  /// The best micro-kernels this CPU runs for float storage, or for bf16 storage (`bf16_storage`: the bf16 dot
  /// products where the CPU has them).
  [[nodiscard]] CpuIsa best(bool bf16_storage = false) const noexcept {
    if (bf16_storage && supports(CpuIsa::kAvx512Bf16)) return CpuIsa::kAvx512Bf16;
    return avx512 ? CpuIsa::kAvx512 : avx2_fma ? CpuIsa::kAvx2 : CpuIsa::kPortable;
  }
  /// e.g. "avx2+fma avx512(f,bw,dq,vl) avx512_bf16", or "none" for a CPU with neither.
  [[nodiscard]] std::string to_string() const {
    std::string s;
    if (avx2_fma) s += "avx2+fma";
    if (avx512) s += s.empty() ? "avx512(f,bw,dq,vl)" : " avx512(f,bw,dq,vl)";
    if (avx512_bf16) s += " avx512_bf16";
    return s.empty() ? "none" : s;
  }
};

/// This CPU's features, read once.
[[nodiscard]] inline const CpuFeatures& cpu_features() noexcept {
  static const CpuFeatures features = [] {
    CpuFeatures f;
#if SEQPAR_CPU_DISPATCH
    __builtin_cpu_init();
    f.avx2_fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    f.avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
    f.avx512_bf16 = f.avx512 && __builtin_cpu_supports("avx512bf16");
#endif
    return f;
  }();
  return features;
}

/// Whether this build and this CPU run `isa`'s micro-kernels (kAuto and kPortable: always).
[[nodiscard]] inline bool cpu_isa_runnable(CpuIsa isa, const CpuFeatures& features = cpu_features()) noexcept {
  return isa == CpuIsa::kAuto || isa == CpuIsa::kPortable || (SEQPAR_CPU_DISPATCH && features.supports(isa));
}

/// The micro-kernels a float or bf16 CpuFlash runs for `requested`: itself when this CPU supports it, the
/// best supported one for kAuto (or what `SEQPAR_CPU_ISA` names, when set); anything else is refused,
/// naming the argument, its value and what the CPU has. `features` is the CPU's (a parameter for tests);
/// `bf16_storage`: the kernel stores bf16 (kAvx512Bf16 is for it only).
[[nodiscard]] inline CpuIsa resolve_cpu_isa(CpuIsa requested, std::string_view where,
                                            const CpuFeatures& features = cpu_features(), bool bf16_storage = false) {
  std::string_view argument = "args.isa";
  if (requested == CpuIsa::kAuto) {
    const char* env = std::getenv("SEQPAR_CPU_ISA");
    if (env == nullptr || *env == '\0') return features.best(bf16_storage);
    const std::optional<CpuIsa> named = parse_cpu_isa(env);
    seqpar::detail::require(named.has_value(), where, "SEQPAR_CPU_ISA", env,
                            "is not an instruction set CpuFlash has kernels for (auto, portable, avx2, avx512, "
                            "avx512bf16)");
    if (*named == CpuIsa::kAuto) return features.best(bf16_storage);
    requested = *named;
    argument = "SEQPAR_CPU_ISA";
  } else if (requested == CpuIsa::kAvx512Bf16 && !bf16_storage) {
    seqpar::detail::throw_invalid(where, argument, to_string(requested),
                                  "the bf16 dot-product tiles are for bf16 storage (CpuFlash<bf16>); float storage "
                                  "has fp32 tiles: use auto or avx512");
  }
  if (!SEQPAR_CPU_DISPATCH && requested != CpuIsa::kPortable)
    seqpar::detail::throw_invalid(where, argument, to_string(requested),
                                  "this build has the portable kernels only (not x86-64 with GCC or Clang, "
                                  "or SEQPAR_NO_CPU_DISPATCH is defined)");
  seqpar::detail::require(features.supports(requested), where, argument, to_string(requested),
                          "this CPU does not support it (it has: " + features.to_string() + "); use auto or " +
                              to_string(features.best(bf16_storage)));
  // The environment variable is process-wide: for float storage avx512bf16 names this CPU's AVX-512 fp32 tiles.
  if (requested == CpuIsa::kAvx512Bf16 && !bf16_storage) return CpuIsa::kAvx512;
  return requested;
}

}  // namespace seqpar::attention
