// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// The index arithmetic of the CUDA attention kernels, shared by device code and host code (the
/// host builds reference tile tables in the tests and sizes workspaces with it): which keys a run of
/// query rows can see, which query rows can see a run of keys, how a slice splits into query tiles
/// and what a tile costs. Everything is in slice-relative coordinates (qi = row - q_range.begin,
/// kj = key - k_range.begin) and int64, as `Mask::visible_keys` is.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "seqpar/core/attn_slice.hpp"

#if defined(__CUDACC__)
#define SEQPAR_HD __host__ __device__
#else
#define SEQPAR_HD
#endif

namespace seqpar::gpu::detail {

struct KeySpan {
  std::int64_t begin = 0;
  std::int64_t end = 0;  ///< empty when end <= begin
};

SEQPAR_HD constexpr std::int64_t clamp64(std::int64_t x, std::int64_t lo, std::int64_t hi) noexcept {
  return x < lo ? lo : (x > hi ? hi : x);
}

/// Keys [begin, end) visible to query row qi (Mask::visible_keys, callable on the device).
SEQPAR_HD constexpr KeySpan visible_keys(const Mask& m, std::int64_t qi, std::int64_t k_len) noexcept {
  if (m.kind == MaskKind::kFull) return {0, k_len};
  const std::int64_t hi = clamp64(qi + m.causal_offset + 1, 0, k_len);
  const std::int64_t lo = m.kind == MaskKind::kSlidingWindow
                              ? clamp64(seqpar::detail::sub_sat(qi + m.causal_offset + 1, m.window), 0, hi)
                              : 0;
  return {lo, hi};
}

/// Union of the keys visible to rows [r0, r1) (r0 < r1): both bounds of the visible range grow with
/// the row, so it is [lo(r0), hi(r1 - 1)).
SEQPAR_HD constexpr KeySpan keys_of_rows(const AttnSlice& s, std::int64_t r0, std::int64_t r1) noexcept {
  const std::int64_t k_len = s.k_range.end - s.k_range.begin;
  const KeySpan first = visible_keys(s.mask, r0, k_len), last = visible_keys(s.mask, r1 - 1, k_len);
  return {first.begin, last.end};
}

/// Query rows of the slice that see at least one key of [c0, c1) (slice-relative keys, clipped to
/// the slice's keys by the caller).
SEQPAR_HD constexpr KeySpan rows_of_keys(const AttnSlice& s, std::int64_t c0, std::int64_t c1) noexcept {
  const std::int64_t q_len = s.q_range.end - s.q_range.begin;
  const std::int64_t k_len = s.k_range.end - s.k_range.begin;
  c0 = clamp64(c0, 0, k_len);
  c1 = clamp64(c1, 0, k_len);
  if (c0 >= c1 || q_len <= 0) return {0, 0};
  if (s.mask.kind == MaskKind::kFull) return {0, q_len};
  // hi(qi) > c0  <=>  qi + offset + 1 > c0; with a window also lo(qi) < c1  <=>  qi + offset + 1 - window < c1.
  const std::int64_t begin = clamp64(c0 - s.mask.causal_offset, 0, q_len);
  const std::int64_t end =
      s.mask.kind == MaskKind::kSlidingWindow
          ? clamp64(seqpar::detail::add_sat(c1 - s.mask.causal_offset - 1, s.mask.window), 0, q_len)
          : q_len;
  return {begin, end};
}

/// Query tiles of `block_rows` rows a slice splits into.
SEQPAR_HD constexpr std::int64_t tiles_of(const AttnSlice& s, int block_rows) noexcept {
  const std::int64_t q_len = s.q_range.end - s.q_range.begin;
  return q_len <= 0 ? 0 : (q_len + block_rows - 1) / block_rows;
}

/// Sort key of tile t of a slice: 1 + the keys its rows span (so that padding, key 0, sorts last).
/// Tiles run longest first: the grid's tail is short tiles, not one long causal tile.
SEQPAR_HD constexpr std::uint32_t tile_cost(const AttnSlice& s, std::int64_t t, int block_rows) noexcept {
  const std::int64_t q_len = s.q_range.end - s.q_range.begin;
  const std::int64_t r0 = t * block_rows, r1 = r0 + block_rows < q_len ? r0 + block_rows : q_len;
  const KeySpan k = keys_of_rows(s, r0, r1);
  const std::int64_t span = k.end > k.begin ? k.end - k.begin : 0;
  return static_cast<std::uint32_t>(span >= 0xFFFFFFF0LL ? 0xFFFFFFF0LL : span + 1);
}

/// A tile of the table: slice index (high 32 bits) and tile index within the slice (low 32 bits).
SEQPAR_HD constexpr std::uint64_t pack_tile(std::int64_t slice, std::int64_t tile) noexcept {
  return (static_cast<std::uint64_t>(slice) << 32) | static_cast<std::uint32_t>(tile);
}
SEQPAR_HD constexpr int tile_slice(std::uint64_t v) noexcept {
  return static_cast<int>(v >> 32);
}
SEQPAR_HD constexpr std::int64_t tile_index(std::uint64_t v) noexcept {
  return static_cast<std::int64_t>(v & 0xFFFFFFFFu);
}

/// Upper bound on the tiles of a call: every tile holds at least one of the q_rows disjoint query
/// rows, and a slice has at most one partial tile.
constexpr std::int64_t max_tiles(std::int64_t q_rows, std::int64_t num_slices, int block_rows) noexcept {
  const std::int64_t by_rows = (q_rows + block_rows - 1) / block_rows + num_slices;
  return std::max<std::int64_t>(0, std::min(q_rows, by_rows));
}

/// What the device builds (scan of tile counts, expansion, radix sort by cost, descending and
/// stable): the reference the tests compare the device table with, and the table
/// `CudaFlash::prepare` builds on the host.
struct TileEntry {
  std::uint32_t cost;
  std::uint64_t tile;
};
inline std::vector<TileEntry> tile_table_reference(std::span<const AttnSlice> slices, int block_rows) {
  std::vector<TileEntry> out;
  for (std::size_t i = 0; i < slices.size(); ++i)
    for (std::int64_t t = 0; t < tiles_of(slices[i], block_rows); ++t)
      out.push_back({tile_cost(slices[i], t, block_rows), pack_tile(static_cast<std::int64_t>(i), t)});
  std::stable_sort(out.begin(), out.end(), [](const TileEntry& a, const TileEntry& b) { return a.cost > b.cost; });
  return out;
}

/// Where a prepared call's block of device memory (`CudaFlashParams`) holds the call's slices, its
/// tile table and the table's length (a 32-bit count, as the kernels read it), each 256-byte aligned.
struct PreparedLayout {
  std::size_t slices = 0, tiles = 0, length = 0, bytes = 0;

  static constexpr std::size_t align(std::size_t n) noexcept { return (n + 255) / 256 * 256; }
  PreparedLayout(std::size_t num_slices, std::size_t num_tiles) {
    tiles = align(num_slices * sizeof(AttnSlice));
    length = tiles + align(num_tiles * sizeof(std::uint64_t));
    bytes = length + align(sizeof(unsigned));
  }
};

/// A prepared call's block as host bytes, laid out by `PreparedLayout(slices.size(), tiles)`: the
/// slices as given, the tiles of `tile_table_reference(slices, block_rows)` and their count. One copy
/// puts it on the device (CudaFlash::prepare, once per cached program).
struct PreparedBlock {
  std::vector<std::byte> bytes;
  std::size_t num_tiles = 0;
};
inline PreparedBlock prepared_block(std::span<const AttnSlice> slices, int block_rows) {
  const std::vector<TileEntry> table = tile_table_reference(slices, block_rows);
  const PreparedLayout layout(slices.size(), table.size());
  PreparedBlock out{std::vector<std::byte>(layout.bytes), table.size()};
  if (!slices.empty()) std::memcpy(out.bytes.data() + layout.slices, slices.data(), slices.size_bytes());
  for (std::size_t i = 0; i < table.size(); ++i)
    std::memcpy(out.bytes.data() + layout.tiles + i * sizeof(std::uint64_t), &table[i].tile, sizeof(std::uint64_t));
  const auto length = static_cast<unsigned>(table.size());
  std::memcpy(out.bytes.data() + layout.length, &length, sizeof(unsigned));
  return out;
}

}  // namespace seqpar::gpu::detail
