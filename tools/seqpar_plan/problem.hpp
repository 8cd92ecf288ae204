// SPDX-License-Identifier: Apache-2.0
// seqpar-plan: from the options to a checked problem (hardware, topology, model, batch, candidates), and
// what both modes print about it.
#pragma once

#include <seqpar/plan/candidates.hpp>
#include <seqpar/plan/model_shape.hpp>
#include <seqpar/plan/step.hpp>
#include <seqpar/replay/hardware.hpp>
#include <seqpar/seqpar.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "options.hpp"

namespace seqpar::tools {

/// Everything a candidate is evaluated on, checked.
struct Problem {
  replay::HardwareProfile hardware;
  Topology topology;
  std::optional<plan::ModelShape> model;  ///< empty with --attention-only and explicit heads
  bool attention_only = false;
  AttentionShape shape;
  DocumentBatch batch;
  AttentionMask mask;  ///< the layers' mask (--window); the placement is balanced for it (`masks`)
  MaskMix masks;
  std::int64_t longest_document = 0;
  std::int64_t documents = 0;  ///< before packing (packing cuts documents that cross a sequence boundary)
  std::string lengths_source;
  std::string dtype;  ///< "bf16", "fp16", "fp32", or the profile's element size ("2-byte elements")
  plan::TrainingOptions training;
  std::vector<plan::Candidate> candidates;
};

/// The options checked against each other and turned into a Problem (the documents read, drawn and packed).
/// Throws UsageError for a bad command line, std::invalid_argument from the library's own checks.
Problem make_problem(const Options& o);

double gib(double bytes);
/// "12.34 GiB"
std::string format_gib(double bytes);
/// "elements: bf16 (2 bytes) ..." for the tables' headers.
std::string describe_elements(const Problem& p);
/// "T tokens in B sequences, N documents (longest L) from SOURCE[; C cuts at sequence boundaries]"
std::string describe_batch(const Problem& p);
/// Writes `text` to `path`; std::runtime_error naming `option` when it cannot.
void write_file(const std::string& path, const std::string& text, const char* option);

}  // namespace seqpar::tools
