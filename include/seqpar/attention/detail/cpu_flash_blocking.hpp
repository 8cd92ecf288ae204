// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// How CpuFlash cuts its work: the block sizes its passes, packers and workspace share (the key tile and the
/// register block are the tile policies', detail/flash_tiles.hpp), and the run-time sizes that follow from its
/// Arguments (`FlashBlocking`).

#include <algorithm>

#include "seqpar/attention/detail/flash_tiles.hpp"

namespace seqpar::attention::detail {

/// The column grain of a register block's score range (col_lo / col_hi): whole 16-float vectors, which every
/// tile policy computes (detail/flash_tiles.hpp, BlockRanges); AVX-512's 64-key panels are entered at the
/// vector holding col_lo instead of being computed whole (1.21x the visible scores on the 4K mix, 1.07x now).
inline constexpr int kColumnGrain = 16;
/// Query rows per score block: S (and dP) are computed for this many rows at once, so that each 16-key
/// panel of K^T (and V in P V) is read from L1 by its 8 register blocks instead of by one (a block of 6
/// rows at a time streams all of K^T and V, 128 KiB at d 128, from L2 per 6 rows).
inline constexpr int kScoreBlock = 8 * kRowBlock;

/// CpuFlash's sizes that its Arguments fix (at construction): the passes, the work list and the workspace
/// layout all read them from here, so that they agree.
struct FlashBlocking {
  int q_tile_rows;   ///< query rows per forward / dQ work item: args.q_tile rounded up to whole register blocks
  int q_block_rows;  ///< query rows per block of the backward: args.backward_q_block, rounded up likewise
  /// Backward lanes: fixed for given Arguments (at least 4 so that 1..4 threads give the same bits).
  int lanes;
  int threads;  ///< args.threads: the workspace holds one tile set per thread
};

/// The blocking of CpuFlashArguments {threads, q_tile, backward_q_block} (checked by CpuFlash's constructor).
[[nodiscard]] constexpr FlashBlocking flash_blocking(int threads, int q_tile, int backward_q_block) noexcept {
  return {(q_tile + kRowBlock - 1) / kRowBlock * kRowBlock, (backward_q_block + kRowBlock - 1) / kRowBlock * kRowBlock,
          std::max(4, threads), threads};
}

}  // namespace seqpar::attention::detail
