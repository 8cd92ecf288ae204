// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
// Umbrella header: the core model, the CPU kernels, the in-process world and the strategies.
// Includes no vendor header (MPI, CUDA and NCCL live behind their own targets).
#pragma once

#include "seqpar/version.hpp"
#include "seqpar/core/attention_shape.hpp"
#include "seqpar/core/attn_slice.hpp"
#include "seqpar/core/document_batch.hpp"
#include "seqpar/core/error.hpp"
#include "seqpar/core/range.hpp"
#include "seqpar/core/tensor.hpp"
#include "seqpar/core/topology.hpp"
#include "seqpar/attention/kernel.hpp"
#include "seqpar/attention/reference.hpp"
