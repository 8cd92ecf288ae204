// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
// The NCCL backend's umbrella: seqpar::backend::nccl::{Transport, Request, FileStore, UniqueId,
// unique_id, nccl_category}. Needs CUDA and NCCL, so it is not part of seqpar/seqpar.hpp: link the
// seqpar::nccl target (it carries seqpar::cuda, NCCL and SEQPAR_ENABLE_NCCL=1).
#pragma once

#if !defined(SEQPAR_ENABLE_NCCL) || !SEQPAR_ENABLE_NCCL
#error "seqpar/backend/nccl.hpp needs NCCL: link seqpar::nccl (which defines SEQPAR_ENABLE_NCCL=1)"
#endif

#include "seqpar/backend/nccl/file_store.hpp"
#include "seqpar/backend/nccl/transport.hpp"
