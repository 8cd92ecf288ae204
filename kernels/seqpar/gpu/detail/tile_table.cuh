// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// The tile table of one kernel call, built on the device from the slices in device memory (the host
/// knows only how many slices there are): per-slice tile counts, an exclusive scan (CUB) to place
/// each slice's tiles, an expansion writing (cost, tile) pairs, and a descending radix sort (CUB) by
/// cost, so that the grid runs the longest tiles first. The table's length, read by the attention
/// kernels, is the last element of the scan; the grid is launched for the host-side bound
/// `max_tiles` and blocks past the length exit.

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#include <cstddef>
#include <cstdint>

#include "seqpar/core/attn_slice.hpp"
#include "seqpar/gpu/check.hpp"
#include "seqpar/gpu/detail/tile_math.hpp"

namespace seqpar::gpu::detail {

// Templates so that the header can be included by several translation units of one program.
template <class = void>
__global__ void count_tiles_kernel(const AttnSlice* slices, int n, int rows_per_tile, unsigned* counts) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n) counts[i] = static_cast<unsigned>(tiles_of(slices[i], rows_per_tile));
  if (i == n) counts[n] = 0;  // the scan's last output is the table length
}

template <class = void>
__global__ void expand_tiles_kernel(const AttnSlice* slices, int n, int rows_per_tile, const unsigned* offsets,
                                    std::uint32_t* keys, std::uint64_t* tiles) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i >= n) return;
  const AttnSlice s = slices[i];
  const std::int64_t count = tiles_of(s, rows_per_tile);
  for (std::int64_t t = 0; t < count; ++t) {
    keys[offsets[i] + t] = tile_cost(s, t, rows_per_tile);
    tiles[offsets[i] + t] = pack_tile(i, t);
  }
}

/// Where the table lives in the workspace, for at most `max_slices` slices and `max_tiles` tiles.
struct TileTableLayout {
  std::size_t counts = 0, offsets = 0, keys_in = 0, keys_out = 0, tiles_in = 0, tiles_out = 0, temp = 0;
  std::size_t temp_bytes = 0;
  std::size_t bytes = 0;  ///< total, from the start of the table's region

  static constexpr std::size_t align(std::size_t n) noexcept { return (n + 255) / 256 * 256; }

  /// Temporary storage CUB needs for the scan of n + 1 counts and the sort of `tiles` pairs.
  static std::size_t cub_bytes(int n, int tiles, const char* where) {
    std::size_t scan = 0, sort = 0;
    SEQPAR_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, scan, static_cast<const unsigned*>(nullptr),
                                                    static_cast<unsigned*>(nullptr), n + 1),
                      where);
    SEQPAR_CUDA_CHECK(
        cub::DeviceRadixSort::SortPairsDescending(
            nullptr, sort, static_cast<const std::uint32_t*>(nullptr), static_cast<std::uint32_t*>(nullptr),
            static_cast<const std::uint64_t*>(nullptr), static_cast<std::uint64_t*>(nullptr), tiles),
        where);
    return scan > sort ? scan : sort;
  }

  TileTableLayout(int max_slices, int max_tiles, std::size_t cub_temp) : temp_bytes(cub_temp) {
    const auto n1 = static_cast<std::size_t>(max_slices) + 1, t = static_cast<std::size_t>(max_tiles);
    std::size_t at = 0;
    const auto take = [&](std::size_t b) {
      const std::size_t here = at;
      at += align(b);
      return here;
    };
    counts = take(n1 * sizeof(unsigned));
    offsets = take(n1 * sizeof(unsigned));
    keys_in = take(t * sizeof(std::uint32_t));
    keys_out = take(t * sizeof(std::uint32_t));
    tiles_in = take(t * sizeof(std::uint64_t));
    tiles_out = take(t * sizeof(std::uint64_t));
    temp = take(cub_temp);
    bytes = at;
  }
};

/// The built table: `tiles[0, *length)` sorted by cost, descending.
struct TileTable {
  const std::uint64_t* tiles = nullptr;
  const unsigned* length = nullptr;
};

/// Builds the table of `n` device slices split into tiles of `rows_per_tile` query rows, in `region`
/// laid out by `layout` (made for at least n slices and `num_tiles` tiles), on `stream`.
inline TileTable build_tile_table(const AttnSlice* slices, int n, int rows_per_tile, int num_tiles,
                                  const TileTableLayout& layout, std::byte* region, cudaStream_t stream,
                                  const char* where) {
  auto* counts = reinterpret_cast<unsigned*>(region + layout.counts);
  auto* offsets = reinterpret_cast<unsigned*>(region + layout.offsets);
  auto* keys_in = reinterpret_cast<std::uint32_t*>(region + layout.keys_in);
  auto* keys_out = reinterpret_cast<std::uint32_t*>(region + layout.keys_out);
  auto* tiles_in = reinterpret_cast<std::uint64_t*>(region + layout.tiles_in);
  auto* tiles_out = reinterpret_cast<std::uint64_t*>(region + layout.tiles_out);
  void* temp = region + layout.temp;
  constexpr int kThreads = 256;
  count_tiles_kernel<><<<(n + 1 + kThreads - 1) / kThreads, kThreads, 0, stream>>>(slices, n, rows_per_tile, counts);
  SEQPAR_CUDA_CHECK(cudaGetLastError(), where);
  std::size_t temp_bytes = layout.temp_bytes;
  SEQPAR_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(temp, temp_bytes, counts, offsets, n + 1, stream), where);
  // Padding past the real tiles keeps cost 0 and sorts after every real tile (costs are >= 1).
  SEQPAR_CUDA_CHECK(cudaMemsetAsync(keys_in, 0, static_cast<std::size_t>(num_tiles) * sizeof(std::uint32_t), stream),
                    where);
  SEQPAR_CUDA_CHECK(cudaMemsetAsync(tiles_in, 0, static_cast<std::size_t>(num_tiles) * sizeof(std::uint64_t), stream),
                    where);
  expand_tiles_kernel<>
      <<<(n + kThreads - 1) / kThreads, kThreads, 0, stream>>>(slices, n, rows_per_tile, offsets, keys_in, tiles_in);
  SEQPAR_CUDA_CHECK(cudaGetLastError(), where);
  temp_bytes = layout.temp_bytes;
  SEQPAR_CUDA_CHECK(cub::DeviceRadixSort::SortPairsDescending(temp, temp_bytes, keys_in, keys_out, tiles_in, tiles_out,
                                                              num_tiles, 0, 32, stream),
                    where);
  return {tiles_out, offsets + n};
}

}  // namespace seqpar::gpu::detail
