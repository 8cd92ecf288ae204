// SPDX-License-Identifier: Apache-2.0
// seqpar: exact distributed attention over packed long-context batches.
#pragma once

/// @file
/// The member functions of `attention::CudnnSdpa<T>` (cudnn_sdpa.hpp): cuDNN's SDPA graphs through
/// cudnn-frontend (header-only, C++17; needs <cudnn.h> and libcudnn). Included by one translation
/// unit per build (kernels/instances_cudnn/cudnn_sdpa.cpp instantiates __half and __nv_bfloat16);
/// everything else includes cudnn_sdpa.hpp and links seqpar::cudnn_instances.
///
/// References (facts and API only): cudnn-frontend's graph API (Graph::sdpa, Graph::sdpa_backward,
/// SDPA_attributes: padding mask with per-item sequence lengths, diagonal alignment BOTTOM_RIGHT,
/// diagonal band bounds, ragged offsets on Tensor_attributes), docs/operations/Attention.md of
/// NVIDIA/cudnn-frontend.

/// Issue 38's hardening (the static review of 2026-12-06, its item names in the comments): items sorted
/// by first query row (A3), windows that cut nothing are causal (B4), the version gates (B2), the device
/// set on every entry (B3), bucketed item counts and graphs built in prepare (C1), the backward's row
/// ranges (C2), cuDNN's deterministic backward on request (A2), CudaFlash for a graph cuDNN will not
/// build. Compiled only: none of it has run on a GPU yet (bench/device/run.sh is the prepared run).

#include <cudnn.h>
#include <cudnn_frontend.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <compare>
#include <cstdio>
#include <cstring>
#include <limits>
#include <list>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "seqpar/core/error.hpp"
#include "seqpar/gpu/check.hpp"
#include "seqpar/gpu/cudnn_sdpa.hpp"
#include "seqpar/gpu/data_ops.hpp"
#include "seqpar/gpu/detail/sdpa_ops.hpp"

namespace seqpar::attention {

namespace detail {

namespace fe = cudnn_frontend;
namespace ops = gpu::detail::sdpa_ops;

inline void cudnn_check(cudnnStatus_t status, const char* call, const char* where) {
  if (status != CUDNN_STATUS_SUCCESS)
    throw Error(Errc::kStepFailed, std::string(where) + ": " + call + " failed: " + cudnnGetErrorString(status));
}

inline void fe_check(fe::error_object e, const char* step, const char* where) {
  if (!e.is_good())
    throw Error(Errc::kStepFailed, std::string(where) + ": cuDNN graph: " + step + ": " + e.get_message());
}

/// A graph cuDNN will not build for a shape on this device (its validation or support check, no engine or
/// plan for it, or a version gate of cudnn_sdpa_version_status): a refusal, thrown as std::invalid_argument
/// naming the head sizes, pass, mask and device with the reason, and caught where CudnnSdpa may fall
/// back to CudaFlash. Other failures (a bad handle, a CUDA error) stay failed steps (fe_check).
struct GraphRefused : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

inline const char* mask_name(gpu::detail::SdpaMask mask) {
  static constexpr const char* kMasks[] = {"no", "bottom-right causal", "sliding-window"};
  return kMasks[std::clamp(static_cast<int>(mask), 0, 2)];
}

[[noreturn]] inline void throw_refused(const std::string& reason, const gpu::CudaExec& exec, Pass pass,
                                       gpu::detail::SdpaMask mask, const AttentionShape& shape, const char* where) {
  const int cc = exec.compute_capability();
  throw GraphRefused(std::string(where) + ": shape.head_dim/head_dim_v = " + std::to_string(shape.qk_dim()) + "/" +
                     std::to_string(shape.v_dim()) + ": cuDNN " + std::to_string(cudnnGetVersion()) +
                     " will not build this " + (pass == Pass::kForward ? "forward" : "backward") + " graph (" +
                     mask_name(mask) + " mask) on device " + std::to_string(exec.device()) + " (compute capability " +
                     std::to_string(cc / 10) + "." + std::to_string(cc % 10) + "): " + reason);
}

inline void fe_build_check(fe::error_object e, const char* step, const gpu::CudaExec& exec, Pass pass,
                           gpu::detail::SdpaMask mask, const AttentionShape& shape, const char* where) {
  if (e.is_good()) return;
  const fe::error_code_t code = e.get_code();
  const bool unsupported =
      code == fe::error_code_t::GRAPH_NOT_SUPPORTED || code == fe::error_code_t::GRAPH_EXECUTION_PLAN_CREATION_FAILED ||
      code == fe::error_code_t::HEURISTIC_QUERY_FAILED || code == fe::error_code_t::UNSUPPORTED_GRAPH_FORMAT;
  if (!unsupported) fe_check(e, step, where);
  throw_refused(std::string(step) + ": " + e.get_message(), exec, pass, mask, shape, where);
}

/// The calling thread's device set to `device` for a scope, and restored after (B3): cuDNN's handle,
/// the Params storage and the workspace are created on the current device.
class DeviceScope {
 public:
  DeviceScope(int device, const char* where) {
    SEQPAR_CUDA_CHECK(cudaGetDevice(&previous_), where);
    if (previous_ != device) SEQPAR_CUDA_CHECK(cudaSetDevice(device), where);
    device_ = device;
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  ~DeviceScope() {
    if (previous_ != device_) (void)cudaSetDevice(previous_);  // a destructor does not throw
  }

 private:
  int previous_ = -1, device_ = -1;
};

// Tensor ids of the variant pack. Ragged offsets: kRagged + the tensor's sdpa_ops::RaggedTensor.
enum Uid : std::int64_t { kQ = 1, kK, kV, kO, kStats, kDo, kDq, kDk, kDv, kSeqQ, kSeqK, kRagged = 20 };

/// What a graph depends on: device, pass, mask, window, bucketed items, bucketed lengths, heads, head
/// sizes (q/k and v), scale, determinism, the strides of the call's views (head and token stride of each
/// of the eight tensors), and for the backward the bucketed buffer rows (max_total_seq_len; the forward
/// does not use them, so its key leaves them 0).
struct GraphKey {
  int device = 0, pass = 0, mask = 0;
  std::int64_t window = 0;
  int items = 0;
  std::int64_t max_q = 0, max_k = 0, total_q = 0, total_k = 0;
  int heads_q = 0, heads_kv = 0, head_dim = 0, head_dim_v = 0;
  float scale = 0.0f;
  bool deterministic = false;
  std::array<std::int64_t, 2 * ops::kTensors> strides{};
  auto operator<=>(const GraphKey&) const = default;
};

struct BuiltGraph {
  std::shared_ptr<fe::graph::Graph> graph;
  std::int64_t workspace = 0;
};

/// One stream's cuDNN handle and workspace (a context is one compute stream; ranks sharing a GPU run
/// on different streams and must not share cuDNN's workspace).
struct StreamResources {
  cudnnHandle_t handle = nullptr;
  gpu::DeviceBytes workspace;
  int device = 0;
};

struct CudnnSdpaState {
  std::mutex mutex;
  std::map<GraphKey, std::pair<BuiltGraph, std::list<GraphKey>::iterator>> graphs;
  std::list<GraphKey> recent;  // most recently used first
  std::map<cudaStream_t, StreamResources> streams;
  std::set<std::string> said;  // fallback reasons already logged
  CudnnSdpaCacheStats stats;

  CudnnSdpaState() = default;
  CudnnSdpaState(const CudnnSdpaState&) = delete;
  CudnnSdpaState& operator=(const CudnnSdpaState&) = delete;
  ~CudnnSdpaState() {
    graphs.clear();
    int previous = -1;
    (void)cudaGetDevice(&previous);  // a destructor does not throw: errors are ignored here
    for (auto& [stream, r] : streams)
      if (r.handle != nullptr) {
        (void)cudaSetDevice(r.device);  // a handle is destroyed on its own device
        (void)cudnnDestroy(r.handle);
      }
    if (previous >= 0) (void)cudaSetDevice(previous);
  }

  // The caller holds the mutex and has set exec's device (DeviceScope).
  StreamResources& on(const gpu::CudaExec& exec, const char* where) {
    StreamResources& r = streams[exec.stream()];
    if (r.handle == nullptr) {
      cudnn_check(cudnnCreate(&r.handle), "cudnnCreate", where);
      r.device = exec.device();
    }
    cudnn_check(cudnnSetStream(r.handle, exec.stream()), "cudnnSetStream", where);
    return r;
  }
};

// The views of a call, in RaggedTensor order (null where the pass has none).
struct CallViews {
  std::array<const void*, ops::kTensors> data{};
  std::array<std::int64_t, ops::kTensors> head_stride{}, token_stride{};
};

/// The views' strides for dense (tokens, heads, width) buffers: what prepare builds graphs for; the
/// backward's gradient scratch is always dense.
inline CallViews dense_views(const AttentionShape& shape) {
  const std::int64_t hq = shape.heads_q, hk = shape.heads_kv, d = shape.qk_dim(), d_v = shape.v_dim();
  CallViews v;
  v.head_stride = {d, d, d_v, d_v, d_v, d, d, d_v};
  v.token_stride = {hq * d, hk * d, hk * d_v, hq * d_v, hq * d_v, hq * d, hk * d, hk * d_v};
  return v;
}

template <class T>
[[nodiscard]] constexpr fe::DataType_t fe_type() noexcept {
  if constexpr (std::is_same_v<T, __half>)
    return fe::DataType_t::HALF;
  else
    return fe::DataType_t::BFLOAT16;
}

inline GraphKey graph_key(const gpu::CudaExec& exec, const CudnnSdpaParams& params, const CudnnSdpaParams::Run& run,
                          const AttentionShape& shape, const CallViews& views, bool deterministic) {
  GraphKey key;
  key.device = exec.device();
  key.pass = static_cast<int>(params.pass);
  key.mask = static_cast<int>(run.mask);
  key.window = run.window;
  key.items = run.items;
  key.max_q = run.max_q;
  key.max_k = run.max_k;
  if (params.pass == Pass::kBackward) {
    key.total_q = gpu::detail::sdpa_bucket(params.q_rows);
    key.total_k = gpu::detail::sdpa_bucket(params.k_rows);
  }
  key.heads_q = shape.heads_q;
  key.heads_kv = shape.heads_kv;
  key.head_dim = shape.qk_dim();
  key.head_dim_v = shape.v_dim();
  key.scale = static_cast<float>(shape.scale());
  key.deterministic = params.pass == Pass::kBackward && deterministic;
  // The forward's graph has Q, K, V and O only: the other tensors' strides stay 0 in its key, so that the
  // graphs prepare builds for dense views are the ones a call with dense views finds.
  const int tensors = params.pass == Pass::kForward ? ops::kDo : ops::kTensors;
  for (int t = 0; t < tensors; ++t) {
    key.strides[2 * t] = views.head_stride[t];
    key.strides[2 * t + 1] = views.token_stride[t];
  }
  return key;
}

/// Builds (or finds) the graph of `key`; the state's mutex is held by the caller, exec's device is set.
/// Throws GraphRefused for a graph cuDNN will not build.
template <class T>
BuiltGraph graph_of(CudnnSdpaState& st, StreamResources& res, const gpu::CudaExec& exec, const GraphKey& key,
                    const CudnnSdpaParams::Run& run, const AttentionShape& shape, const CallViews& views,
                    const char* where) {
  if (auto it = st.graphs.find(key); it != st.graphs.end()) {
    st.recent.splice(st.recent.begin(), st.recent, it->second.second);
    return it->second.first;
  }
  const auto started = std::chrono::steady_clock::now();
  const Pass pass = static_cast<Pass>(key.pass);
  // B4 keeps windows that cut nothing out of the window runs: a window left is below an item's s_kv.
  if (run.mask == gpu::detail::SdpaMask::kWindow && run.window > std::numeric_limits<int>::max())
    throw_refused("a sliding window of " + std::to_string(run.window) + " keys exceeds cuDNN's int band bound", exec,
                  pass, run.mask, shape, where);

  using Attr = fe::graph::Tensor_attributes;
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(fe_type<T>())
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  const std::int64_t b = run.items;
  const auto ragged = [&](int t) {
    return g->tensor(Attr()
                         .set_name("ragged_" + std::to_string(t))
                         .set_uid(kRagged + t)
                         .set_dim({b + 1, 1, 1, 1})
                         .set_stride({1, 1, 1, 1})
                         .set_data_type(fe::DataType_t::INT32));
  };
  // (B, H, S, D) over a THD view: S strides by tokens, H by heads; the batch stride is never used
  // (ragged offsets place each item), it only has to describe a non-overlapping layout. D is the
  // tensor's own head size: qk_dim for Q, K, dQ, dK, v_dim for V, O, dO, dV.
  const auto dims = [&](int t, int heads, std::int64_t s) {
    const bool v_side = t == ops::kV || t == ops::kO || t == ops::kDo || t == ops::kDv;
    const std::int64_t d = v_side ? shape.v_dim() : shape.qk_dim();
    return std::pair<std::vector<std::int64_t>, std::vector<std::int64_t>>{
        {b, heads, s, d}, {s * views.token_stride[t], views.head_stride[t], views.token_stride[t], 1}};
  };
  const auto input = [&](const char* name, int t, int uid, int heads, std::int64_t s) {
    const auto [dim, stride] = dims(t, heads, s);
    return g->tensor(Attr().set_name(name).set_uid(uid).set_dim(dim).set_stride(stride).set_ragged_offset(ragged(t)));
  };
  const auto output = [&](const std::shared_ptr<Attr>& x, int t, int uid, int heads, std::int64_t s) {
    const auto [dim, stride] = dims(t, heads, s);
    x->set_output(true).set_uid(uid).set_dim(dim).set_stride(stride).set_ragged_offset(ragged(t));
  };
  const auto lengths = [&](const char* name, int uid) {
    return g->tensor(Attr()
                         .set_name(name)
                         .set_uid(uid)
                         .set_dim({b, 1, 1, 1})
                         .set_stride({1, 1, 1, 1})
                         .set_data_type(fe::DataType_t::INT32));
  };
  const auto q = input("q", ops::kQ, kQ, shape.heads_q, run.max_q);
  const auto k = input("k", ops::kK, kK, shape.heads_kv, run.max_k);
  const auto v = input("v", ops::kV, kV, shape.heads_kv, run.max_k);
  const auto seq_q = lengths("seq_q", kSeqQ), seq_k = lengths("seq_kv", kSeqK);
  // The statistics stay padded (b, h, S_q, 1) and carry no ragged offset: with ragged statistics some
  // cuDNN releases (9.22-9.26) silently returned all-zero gradients (cudnn-frontend PR #462; that branch
  // fires only when Stats has a ragged offset). tests/cuda/test_sdpa_items_host.cpp holds the bound.
  const std::vector<std::int64_t> stats_dim{b, shape.heads_q, run.max_q, 1},
      stats_stride{shape.heads_q * run.max_q, run.max_q, 1, 1};

  const auto masked = [&](auto& attrs) {
    attrs.set_attn_scale(key.scale).set_padding_mask(true).set_seq_len_q(seq_q).set_seq_len_kv(seq_k);
    if (run.mask != gpu::detail::SdpaMask::kFull)
      attrs.set_diagonal_alignment(fe::DiagonalAlignment_t::BOTTOM_RIGHT).set_diagonal_band_right_bound(0);
    if (run.mask == gpu::detail::SdpaMask::kWindow) attrs.set_diagonal_band_left_bound(static_cast<int>(run.window));
  };
  if (pass == Pass::kForward) {
    auto attrs = fe::graph::SDPA_attributes().set_name("seqpar_sdpa").set_generate_stats(true);
    masked(attrs);
    auto [o, stats] = g->sdpa(q, k, v, std::move(attrs));
    output(o, ops::kO, kO, shape.heads_q, run.max_q);
    stats->set_output(true)
        .set_uid(kStats)
        .set_data_type(fe::DataType_t::FLOAT)
        .set_dim(stats_dim)
        .set_stride(stats_stride);
  } else {
    const auto o = input("o", ops::kO, kO, shape.heads_q, run.max_q);
    const auto dout = input("dout", ops::kDo, kDo, shape.heads_q, run.max_q);
    const auto stats = g->tensor(Attr()
                                     .set_name("stats")
                                     .set_uid(kStats)
                                     .set_dim(stats_dim)
                                     .set_stride(stats_stride)
                                     .set_data_type(fe::DataType_t::FLOAT));
    auto attrs = fe::graph::SDPA_backward_attributes().set_name("seqpar_sdpa_backward");
    masked(attrs);
    attrs.set_max_total_seq_len_q(key.total_q).set_max_total_seq_len_kv(key.total_k);
    // A2: cuDNN's backward is deterministic only on request (is_deterministic_algorithm defaults to false).
    attrs.set_deterministic_algorithm(key.deterministic);
    auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, dout, stats, std::move(attrs));
    output(dq, ops::kDq, kDq, shape.heads_q, run.max_q);
    output(dk, ops::kDk, kDk, shape.heads_kv, run.max_k);
    output(dv, ops::kDv, kDv, shape.heads_kv, run.max_k);
  }
  const auto build = [&](fe::error_object e, const char* step) {
    fe_build_check(std::move(e), step, exec, pass, run.mask, shape, where);
  };
  build(g->validate(), "validate");
  build(g->build_operation_graph(res.handle), "build_operation_graph");
  build(g->create_execution_plans({fe::HeurMode_t::A}), "create_execution_plans");
  build(g->check_support(res.handle), "check_support");
  build(g->build_plans(), "build_plans");
  BuiltGraph built{g, 0};
  fe_check(g->get_workspace_size(built.workspace), "get_workspace_size", where);

  if (st.graphs.size() >= CudnnSdpa<T>::kMaxGraphs) {
    st.graphs.erase(st.recent.back());
    st.recent.pop_back();
  }
  st.recent.push_front(key);
  st.graphs.emplace(key, std::pair{built, st.recent.begin()});
  ++st.stats.graphs_built;
  st.stats.build_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  return built;
}

/// The call's scratch in the caller's workspace: padded statistics, then the gradient scratch.
template <class T>
struct Scratch {
  float* stats = nullptr;
  T *dq = nullptr, *dk = nullptr, *dv = nullptr;
  std::size_t bytes = 0;

  static constexpr std::size_t aligned(std::size_t n) noexcept { return (n + 255) / 256 * 256; }
  Scratch(const AttentionShape& shape, std::int64_t q_rows, std::int64_t k_rows, std::byte* base) {
    const auto hq = static_cast<std::size_t>(shape.heads_q), hk = static_cast<std::size_t>(shape.heads_kv);
    const auto d = static_cast<std::size_t>(shape.qk_dim()), d_v = static_cast<std::size_t>(shape.v_dim());
    const auto qn = static_cast<std::size_t>(std::max<std::int64_t>(q_rows, 0));
    const auto kn = static_cast<std::size_t>(std::max<std::int64_t>(k_rows, 0));
    // Runs are cut at items x longest query <= 2 q_rows; the buckets of both at most double each.
    const std::size_t s =
        aligned(sizeof(float) * hq *
                static_cast<std::size_t>(gpu::detail::sdpa_graph_stats_rows_bound(static_cast<std::int64_t>(qn))));
    const std::size_t q = aligned(sizeof(T) * qn * hq * d), k = aligned(sizeof(T) * kn * hk * d),
                      v = aligned(sizeof(T) * kn * hk * d_v);
    bytes = s + q + k + v;
    if (base == nullptr) return;
    stats = reinterpret_cast<float*>(base);
    dq = reinterpret_cast<T*>(base + s);
    dk = reinterpret_cast<T*>(base + s + q);
    dv = reinterpret_cast<T*>(base + s + q + k);
  }
};

}  // namespace detail

template <class T>
CudnnSdpa<T>::CudnnSdpa() : CudnnSdpa(gpu::CudaExec{}) {}

template <class T>
CudnnSdpa<T>::CudnnSdpa(gpu::CudaExec exec, Arguments arguments)
    : exec_(std::move(exec)),
      arguments_(arguments),
      cuda_flash_(exec_),
      state_(std::make_shared<detail::CudnnSdpaState>()) {}

template <class T>
CudnnVersions CudnnSdpa<T>::versions() {
  return {static_cast<std::int64_t>(cudnnGetVersion()), std::int64_t{CUDNN_FRONTEND_VERSION}};
}

template <class T>
Status CudnnSdpa<T>::can_implement(const gpu::CudaExec& exec, const AttentionShape& shape) const {
  const int cc = exec.compute_capability();
  if (Status s = cudnn_sdpa_shape_status(shape, cc, "CudnnSdpa"); !s) return s;
  CudnnSdpaFeatures features;
  features.deterministic = arguments_.deterministic;
  return cudnn_sdpa_version_status(versions(), cc, shape, features, "CudnnSdpa");
}

template <class T>
CudnnSdpaCacheStats CudnnSdpa<T>::cache_stats() const {
  std::lock_guard lock(state_->mutex);
  CudnnSdpaCacheStats s = state_->stats;
  s.graphs_cached = state_->graphs.size();
  return s;
}

template <class T>
std::size_t CudnnSdpa<T>::workspace_bytes(const AttentionShape& shape, std::int64_t q_rows, std::int64_t k_rows) const {
  std::size_t bytes = detail::Scratch<T>(shape, q_rows, k_rows, nullptr).bytes;
  // Room for CudaFlash's scratch where a call may fall back to it.
  if (arguments_.fallback && cuda_flash_.can_implement(shape))
    bytes = std::max(bytes, cuda_flash_.workspace_bytes(shape, q_rows, k_rows));
  return bytes;
}

namespace detail {

// Whether a refused graph may run on CudaFlash instead; if so says why once per reason (stderr: the
// project has no logger, and a training step must not stop for it).
template <class T>
bool fall_back(CudnnSdpaState& st, const CudnnSdpaArguments& args, const CudaFlash<T>& flash, const gpu::CudaExec& exec,
               const AttentionShape& shape, const GraphRefused& why) {
  if (!args.fallback || !flash.can_implement(exec, shape)) return false;
  std::lock_guard lock(st.mutex);
  ++st.stats.fallbacks;
  if (st.said.insert(why.what()).second)
    std::fprintf(stderr, "seqpar: %s; such calls run on CudaFlash (CudnnSdpa::Arguments::fallback)\n", why.what());
  return true;
}

// The graphs of every run of a call, found or built before any of them runs (a backward adds into dQ,
// dK, dV run by run: a refusal after the first run could not be redone on CudaFlash), and the stream's
// cuDNN workspace grown to the largest of them. Throws GraphRefused.
template <class T>
std::vector<BuiltGraph> graphs_for(CudnnSdpaState& st, const gpu::CudaExec& exec, const CudnnSdpaParams& p,
                                   const AttentionShape& shape, const CallViews& views, bool deterministic,
                                   const char* where) {
  std::lock_guard lock(st.mutex);
  StreamResources& res = st.on(exec, where);
  std::vector<BuiltGraph> graphs;
  graphs.reserve(p.runs.size());
  std::int64_t need = 0;
  for (const CudnnSdpaParams::Run& run : p.runs) {
    graphs.push_back(
        graph_of<T>(st, res, exec, graph_key(exec, p, run, shape, views, deterministic), run, shape, views, where));
    need = std::max(need, graphs.back().workspace);
  }
  if (static_cast<std::int64_t>(res.workspace.size()) < need) {
    SEQPAR_CUDA_CHECK(cudaStreamSynchronize(exec.stream()), where);  // the old workspace may be in use
    res.workspace = gpu::DeviceBytes(static_cast<std::size_t>(need));
    st.stats.cudnn_workspace = std::max(st.stats.cudnn_workspace, static_cast<std::size_t>(need));
  }
  return graphs;
}

}  // namespace detail

template <class T>
CudnnSdpaParams CudnnSdpa<T>::prepare(const gpu::CudaExec& exec, const AttentionShape& shape,
                                      std::span<const AttnSlice> host_slices, std::int64_t q_rows, std::int64_t k_rows,
                                      Pass pass) const {
  constexpr const char* where = "CudnnSdpa::prepare";
  seqpar::detail::throw_if_refused(can_implement(exec, shape));
  validate_slices(host_slices, q_rows, k_rows, where);
  const detail::DeviceScope scope(exec.device(), where);
  const auto runs =
      gpu::detail::sdpa_runs(gpu::detail::sdpa_items(host_slices, where), q_rows, pass == Pass::kBackward);

  Params p;
  p.pass = pass;
  p.q_rows = q_rows;
  p.k_rows = k_rows;
  p.num_slices = static_cast<std::int64_t>(host_slices.size());
  // Host image of the device block: per run its token tables, lengths, row prefixes and room for the
  // offsets (every entry past the real items written: zero lengths, the run's end).
  std::vector<gpu::detail::SdpaRunTables> tables;
  tables.reserve(runs.size());
  for (const auto& r : runs) tables.push_back(gpu::detail::sdpa_run_tables(r, arguments_.pad_items));
  const auto aligned = [](std::size_t n) { return (n + 255) / 256 * 256; };
  const auto run_bytes = [&](std::size_t m) {
    return 4 * aligned(8 * (m + 1)) + 2 * aligned(4 * m) + aligned(4 * gpu::detail::sdpa_ops::kTensors * (m + 1));
  };
  std::vector<std::size_t> at;
  std::size_t total = 0;
  for (const auto& t : tables) {
    at.push_back(total);
    total += run_bytes(static_cast<std::size_t>(t.padded));
  }
  std::vector<std::byte> host(total);
  for (std::size_t i = 0; i < tables.size(); ++i) {
    const auto& t = tables[i];
    const auto m = static_cast<std::size_t>(t.padded);
    std::size_t o = at[i];
    const auto put = [&](const void* src, std::size_t bytes) {
      std::memcpy(host.data() + o, src, bytes);
      o += aligned(bytes);
    };
    put(t.q_tokens.data(), 8 * (m + 1));
    put(t.k_tokens.data(), 8 * (m + 1));
    put(t.q_lens.data(), 4 * m);
    put(t.k_lens.data(), 4 * m);
    put(t.rows_q.data(), 8 * (m + 1));
    put(t.rows_k.data(), 8 * (m + 1));
  }
  p.storage = gpu::DeviceBytes(total);
  if (total != 0) {
    SEQPAR_CUDA_CHECK(cudaMemcpyAsync(p.storage.data(), host.data(), total, cudaMemcpyHostToDevice, exec.stream()),
                      where);
    SEQPAR_CUDA_CHECK(cudaStreamSynchronize(exec.stream()), where);  // `host` dies here
  }
  auto* base = static_cast<std::byte*>(p.storage.data());
  for (std::size_t i = 0; i < runs.size(); ++i) {
    const auto& r = runs[i];
    const auto m = static_cast<std::size_t>(tables[i].padded);
    Params::Run run;
    run.mask = r.mask;
    run.window = r.window;
    run.items = static_cast<int>(m);
    run.max_q = gpu::detail::sdpa_bucket(r.max_q);
    run.max_k = gpu::detail::sdpa_bucket(r.max_k);
    run.rows_q = tables[i].rows_q[m];
    run.rows_k = tables[i].rows_k[m];
    std::byte* o = base + at[i];
    const auto take = [&](auto*& ptr, std::size_t bytes) {
      ptr = reinterpret_cast<std::remove_reference_t<decltype(ptr)>>(o);
      o += aligned(bytes);
    };
    take(run.q_tokens, 8 * (m + 1));
    take(run.k_tokens, 8 * (m + 1));
    take(run.q_lens, 4 * m);
    take(run.k_lens, 4 * m);
    take(run.q_prefix, 8 * (m + 1));
    take(run.k_prefix, 8 * (m + 1));
    run.ragged = reinterpret_cast<std::int32_t*>(o);
    p.runs.push_back(run);
  }

  // The mask-dependent version gates, then the graphs for dense views (C1: built here, once per cached
  // program, not inside the timed call); a refusal of either runs the program's call on CudaFlash.
  try {
    for (const Params::Run& run : p.runs) {
      CudnnSdpaFeatures features;
      features.bottom_right = run.mask != gpu::detail::SdpaMask::kFull;
      features.window = run.mask == gpu::detail::SdpaMask::kWindow;
      features.deterministic = arguments_.deterministic && pass == Pass::kBackward;
      if (Status s = cudnn_sdpa_version_status(versions(), exec.compute_capability(), shape, features, where); !s)
        detail::throw_refused(s.reason, exec, pass, run.mask, shape, where);
    }
    (void)detail::graphs_for<T>(*state_, exec, p, shape, detail::dense_views(shape), arguments_.deterministic, where);
  } catch (const detail::GraphRefused& why) {
    if (!detail::fall_back(*state_, arguments_, cuda_flash_, exec, shape, why)) throw;
    Params flash;
    flash.pass = pass;
    flash.q_rows = q_rows;
    flash.k_rows = k_rows;
    flash.num_slices = p.num_slices;
    flash.on_cuda_flash = true;
    flash.cuda_flash = cuda_flash_.prepare(exec, shape, host_slices, q_rows, k_rows, pass);
    return flash;
  }
  return p;
}

namespace detail {

// The checks every call makes before any work (the views against the shape, the workspace, the
// Params against the call, int32 offsets).
template <class T>
void check_call(const CudnnSdpa<T>& kernel, const gpu::CudaExec& exec, const CudnnSdpaParams& p, Pass pass,
                const AttentionShape& shape, ThdView<const T> q, ThdView<const T> k, ThdView<const T> v,
                std::span<const AttnSlice> slices, std::span<std::byte> workspace, const char* where) {
  seqpar::detail::throw_if_refused(kernel.can_implement(exec, shape));
  seqpar::detail::check_view(q, where, "q", q.tokens, shape.heads_q, shape.qk_dim());
  seqpar::detail::check_view(k, where, "k", k.tokens, shape.heads_kv, shape.qk_dim());
  seqpar::detail::check_view(v, where, "v", k.tokens, shape.heads_kv, shape.v_dim());
  const auto mismatch = [&](const char* what, std::int64_t have, std::int64_t want) {
    seqpar::detail::throw_invalid(where, std::string("params.") + what, have,
                                  "the call has " + std::to_string(want) + ": pass the Params prepare() made for it");
  };
  if (p.pass != pass) mismatch("pass", static_cast<int>(p.pass), static_cast<int>(pass));
  if (p.q_rows != q.tokens) mismatch("q_rows", p.q_rows, q.tokens);
  if (p.k_rows != k.tokens) mismatch("k_rows", p.k_rows, k.tokens);
  if (p.num_slices != static_cast<std::int64_t>(slices.size()))
    mismatch("num_slices", p.num_slices, static_cast<std::int64_t>(slices.size()));
  const std::size_t need = kernel.workspace_bytes(shape, q.tokens, k.tokens);
  if (workspace.size() < need)
    seqpar::detail::throw_invalid(where, "workspace.size()", workspace.size(),
                                  "needs workspace_bytes() = " + std::to_string(need));
}

inline void check_offsets(const char* where, const char* name, std::int64_t tokens, std::int64_t token_stride) {
  if (tokens * token_stride >= (std::int64_t{1} << 31))
    seqpar::detail::throw_invalid(where, std::string(name) + ".tokens", tokens,
                                  "times its token stride " + std::to_string(token_stride) +
                                      " reaches 2^31 elements: cuDNN's ragged offsets are int32 here");
}

// Runs one graph on `exec`'s stream: ragged offsets for these views, then the graph (its workspace
// grown by graphs_for).
inline void execute(CudnnSdpaState& st, const gpu::CudaExec& exec, const CudnnSdpaParams& p,
                    const CudnnSdpaParams::Run& run, const BuiltGraph& graph, const CallViews& views, float* stats,
                    const char* where) {
  ops::RaggedStrides strides;
  for (int t = 0; t < ops::kTensors; ++t) strides.token_stride[t] = views.token_stride[t];
  ops::ragged_offsets(exec.stream(), run.q_tokens, run.k_tokens, run.items, strides, run.ragged);
  std::unordered_map<std::int64_t, void*> pack;
  const Uid uid_of[ops::kTensors] = {kQ, kK, kV, kO, kDo, kDq, kDk, kDv};
  const bool forward = p.pass == Pass::kForward;
  for (int t = 0; t < ops::kTensors; ++t) {
    const bool used = forward ? (t == ops::kQ || t == ops::kK || t == ops::kV || t == ops::kO) : true;
    if (!used) continue;
    pack[uid_of[t]] = const_cast<void*>(views.data[t]);
    pack[kRagged + t] = run.ragged + static_cast<std::ptrdiff_t>(t) * (run.items + 1);
  }
  pack[kStats] = stats;
  pack[kSeqQ] = run.q_lens;
  pack[kSeqK] = run.k_lens;
  std::lock_guard lock(st.mutex);
  StreamResources& res = st.on(exec, where);
  fe_check(graph.graph->execute(res.handle, pack, res.workspace.data()), "execute", where);
}

}  // namespace detail

template <class T>
void CudnnSdpa<T>::forward(const gpu::CudaExec& exec, const Params& params, const AttentionShape& shape,
                           ThdView<const T> q, ThdView<const T> k, ThdView<const T> v,
                           std::span<const AttnSlice> slices, ThdView<T> o, LseView<float> lse,
                           std::span<std::byte> workspace) {
  constexpr const char* where = "CudnnSdpa::forward";
  const detail::DeviceScope scope(exec.device(), where);
  if (params.on_cuda_flash) {
    cuda_flash_.forward(exec, params.cuda_flash, shape, q, k, v, slices, o, lse, workspace);
    return;
  }
  detail::check_call(*this, exec, params, Pass::kForward, shape, q, k, v, slices, workspace, where);
  seqpar::detail::check_view(o, where, "o", q.tokens, shape.heads_q, shape.v_dim());
  seqpar::detail::check_view(lse, where, "lse", shape.heads_q, q.tokens);
  detail::check_offsets(where, "q", q.tokens, q.token_stride);
  detail::check_offsets(where, "o", o.tokens, o.token_stride);
  detail::check_offsets(where, "k", k.tokens, std::max(k.token_stride, v.token_stride));
  const detail::Scratch<T> scratch(shape, q.tokens, k.tokens, workspace.data());
  detail::CallViews views;
  views.data = {q.data, k.data, v.data, o.data, nullptr, nullptr, nullptr, nullptr};
  views.head_stride = {q.head_stride, k.head_stride, v.head_stride, o.head_stride, 0, 0, 0, 0};
  views.token_stride = {q.token_stride, k.token_stride, v.token_stride, o.token_stride, 0, 0, 0, 0};
  std::vector<detail::BuiltGraph> graphs;
  try {
    graphs = detail::graphs_for<T>(*state_, exec, params, shape, views, arguments_.deterministic, where);
  } catch (const detail::GraphRefused& why) {
    if (!detail::fall_back(*state_, arguments_, cuda_flash_, exec, shape, why)) throw;
    cuda_flash_.forward(exec, shape, q, k, v, slices, o, lse, workspace);
    return;
  }
  // Rows of no item keep O = 0 and LSE = -inf; the runs overwrite the others.
  runtime::DataOps<gpu::CudaExec>::fill_empty<T, float>(exec, o, lse);
  for (std::size_t i = 0; i < params.runs.size(); ++i) {
    const Params::Run& run = params.runs[i];
    detail::execute(*state_, exec, params, run, graphs[i], views, scratch.stats, where);
    gpu::detail::sdpa_ops::scatter_stats(exec.stream(), scratch.stats, run.q_tokens, run.q_lens, run.items,
                                         shape.heads_q, run.max_q, lse);
  }
}

template <class T>
void CudnnSdpa<T>::backward(const gpu::CudaExec& exec, const Params& params, const AttentionShape& shape,
                            ThdView<const T> q, ThdView<const T> k, ThdView<const T> v, ThdView<const T> o,
                            LseView<const float> lse, ThdView<const T> dout, std::span<const AttnSlice> slices,
                            ThdView<T> dq, ThdView<T> dk, ThdView<T> dv, std::span<std::byte> workspace) {
  constexpr const char* where = "CudnnSdpa::backward";
  const detail::DeviceScope scope(exec.device(), where);
  if (params.on_cuda_flash) {
    cuda_flash_.backward(exec, params.cuda_flash, shape, q, k, v, o, lse, dout, slices, dq, dk, dv, workspace);
    return;
  }
  detail::check_call(*this, exec, params, Pass::kBackward, shape, q, k, v, slices, workspace, where);
  seqpar::detail::check_view(o, where, "o", q.tokens, shape.heads_q, shape.v_dim());
  seqpar::detail::check_view(lse, where, "lse", shape.heads_q, q.tokens);
  seqpar::detail::check_view(dout, where, "dout", q.tokens, shape.heads_q, shape.v_dim());
  seqpar::detail::check_view(dq, where, "dq", q.tokens, shape.heads_q, shape.qk_dim());
  seqpar::detail::check_view(dk, where, "dk", k.tokens, shape.heads_kv, shape.qk_dim());
  seqpar::detail::check_view(dv, where, "dv", k.tokens, shape.heads_kv, shape.v_dim());
  for (const auto& [name, tokens, stride] :
       {std::tuple{"q", q.tokens, q.token_stride}, std::tuple{"o", o.tokens, o.token_stride},
        std::tuple{"dout", dout.tokens, dout.token_stride}, std::tuple{"k", k.tokens, k.token_stride},
        std::tuple{"v", v.tokens, v.token_stride}})
    detail::check_offsets(where, name, tokens, stride);
  const detail::Scratch<T> scratch(shape, q.tokens, k.tokens, workspace.data());
  // The gradient scratch is dense (tokens, heads, width): dQ, dK of qk_dim, dV of v_dim.
  const std::int64_t hq = shape.heads_q, hk = shape.heads_kv, d = shape.qk_dim(), d_v = shape.v_dim();
  detail::CallViews views;
  views.data = {q.data, k.data, v.data, o.data, dout.data, scratch.dq, scratch.dk, scratch.dv};
  views.head_stride = {q.head_stride, k.head_stride, v.head_stride, o.head_stride, dout.head_stride, d, d, d_v};
  views.token_stride = {q.token_stride,    k.token_stride, v.token_stride, o.token_stride,
                        dout.token_stride, hq * d,         hk * d,         hk * d_v};
  std::vector<detail::BuiltGraph> graphs;
  try {
    graphs = detail::graphs_for<T>(*state_, exec, params, shape, views, arguments_.deterministic, where);
  } catch (const detail::GraphRefused& why) {
    if (!detail::fall_back(*state_, arguments_, cuda_flash_, exec, shape, why)) throw;
    cuda_flash_.backward(exec, shape, q, k, v, o, lse, dout, slices, dq, dk, dv, workspace);
    return;
  }
  namespace ops = gpu::detail::sdpa_ops;
  const auto dense = [](T* data, std::int64_t tokens, std::int64_t heads, std::int64_t width) {
    return ThdView<T>{data, tokens, static_cast<int>(heads), static_cast<int>(width), heads * width, width};
  };
  const ThdView<T> sdq = dense(scratch.dq, q.tokens, hq, d), sdk = dense(scratch.dk, k.tokens, hk, d),
                   sdv = dense(scratch.dv, k.tokens, hk, d_v);
  for (std::size_t i = 0; i < params.runs.size(); ++i) {
    const Params::Run& run = params.runs[i];
    // cuDNN writes its gradients: the run's rows of a scratch are zeroed, written, then added (C2: only
    // the rows of the run's items, never whole buffers).
    const ops::RowRanges q_rows{run.q_tokens, run.q_prefix, run.items, run.rows_q};
    const ops::RowRanges k_rows{run.k_tokens, run.k_prefix, run.items, run.rows_k};
    ops::zero_rows<T>(exec.stream(), sdq, q_rows);
    ops::zero_rows<T>(exec.stream(), sdk, k_rows);
    ops::zero_rows<T>(exec.stream(), sdv, k_rows);
    ops::gather_stats(exec.stream(), lse, run.q_tokens, run.q_lens, run.items, shape.heads_q, run.max_q, scratch.stats);
    detail::execute(*state_, exec, params, run, graphs[i], views, scratch.stats, where);
    ops::accumulate_rows<T>(exec.stream(), dq, scratch.dq, q_rows);
    ops::accumulate_rows<T>(exec.stream(), dk, scratch.dk, k_rows);
    ops::accumulate_rows<T>(exec.stream(), dv, scratch.dv, k_rows);
  }
}

namespace detail {

// A direct call: the slice table comes back to the host and is planned now; the call then waits for
// its work (its Params die with it).
template <class T>
CudnnSdpaParams prepare_direct(const CudnnSdpa<T>& kernel, const gpu::CudaExec& exec, const AttentionShape& shape,
                               std::span<const AttnSlice> slices, std::int64_t q_rows, std::int64_t k_rows, Pass pass,
                               const char* where) {
  const DeviceScope scope(exec.device(), where);
  std::vector<AttnSlice> host(slices.size());
  if (!slices.empty()) {
    SEQPAR_CUDA_CHECK(
        cudaMemcpyAsync(host.data(), slices.data(), slices.size_bytes(), cudaMemcpyDefault, exec.stream()), where);
    SEQPAR_CUDA_CHECK(cudaStreamSynchronize(exec.stream()), where);
  }
  return kernel.prepare(exec, shape, host, q_rows, k_rows, pass);
}

}  // namespace detail

template <class T>
void CudnnSdpa<T>::forward(const gpu::CudaExec& exec, const AttentionShape& shape, ThdView<const T> q,
                           ThdView<const T> k, ThdView<const T> v, std::span<const AttnSlice> slices, ThdView<T> o,
                           LseView<float> lse, std::span<std::byte> workspace) {
  const Params p =
      detail::prepare_direct(*this, exec, shape, slices, q.tokens, k.tokens, Pass::kForward, "CudnnSdpa::forward");
  forward(exec, p, shape, q, k, v, slices, o, lse, workspace);
  exec.synchronize();
}

template <class T>
void CudnnSdpa<T>::backward(const gpu::CudaExec& exec, const AttentionShape& shape, ThdView<const T> q,
                            ThdView<const T> k, ThdView<const T> v, ThdView<const T> o, LseView<const float> lse,
                            ThdView<const T> dout, std::span<const AttnSlice> slices, ThdView<T> dq, ThdView<T> dk,
                            ThdView<T> dv, std::span<std::byte> workspace) {
  const Params p =
      detail::prepare_direct(*this, exec, shape, slices, q.tokens, k.tokens, Pass::kBackward, "CudnnSdpa::backward");
  backward(exec, p, shape, q, k, v, o, lse, dout, slices, dq, dk, dv, workspace);
  exec.synchronize();
}

}  // namespace seqpar::attention
