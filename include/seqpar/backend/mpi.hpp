// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
// The MPI backend's umbrella: seqpar::backend::mpi::{Transport, Request, Environment, run_or_abort,
// mpi_category}. Needs <mpi.h>, so it is not part of seqpar/seqpar.hpp: link the seqpar::mpi target
// (it carries MPI::MPI_CXX and SEQPAR_ENABLE_MPI=1).
#pragma once

#if !defined(SEQPAR_ENABLE_MPI) || !SEQPAR_ENABLE_MPI
#error "seqpar/backend/mpi.hpp needs MPI: link seqpar::mpi (which defines SEQPAR_ENABLE_MPI=1)"
#endif

#include "seqpar/backend/mpi/transport.hpp"
