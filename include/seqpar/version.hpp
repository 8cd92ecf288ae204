// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

#define SEQPAR_VERSION_MAJOR 0
#define SEQPAR_VERSION_MINOR 1
#define SEQPAR_VERSION_PATCH 0
