// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// seqpar on Kokkos (target seqpar::kokkos): the attention kernel `attention::KokkosFlash<ExecSpace, T>`,
/// its execution context `kokkos::KokkosExec<ExecSpace>` with the executor's DataOps, and the
/// Kokkos::View adapters `kokkos::as_thd` / `kokkos::as_lse` / `kokkos::as_view`.

#include "seqpar/kokkos/exec.hpp"
#include "seqpar/kokkos/flash.hpp"
#include "seqpar/kokkos/views.hpp"
