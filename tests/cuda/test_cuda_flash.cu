// SPDX-License-Identifier: Apache-2.0
// CudaFlash (kernels/seqpar/cuda/flash.hpp) against the fp64 reference, forward and backward: every
// mask, GQA, head dims 64 and 128, lengths 1, 7 and 1111, fully masked rows, documents of length 1,
// rows in no slice, slices sharing keys; fp32 at 1e-4, fp16/bf16 at TransformerEngine's 2.5e-2
// (errors relative to the largest reference value); the backward bitwise reproducible; the device
// tile table equal to the host reference; bad arguments named. Runs only with a CUDA device (the main
// exits 77 otherwise). A .cu for the tile table's device code (detail/tile_table.cuh); CudaFlash
// itself comes compiled from seqpar::cuda_instances (flash.hpp here, not flash.cuh).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "seqpar/attention/reference.hpp"
#include "seqpar/core/document_batch.hpp"
#include "seqpar/cuda/detail/tile_table.cuh"
#include "seqpar/cuda/device_memory.hpp"
#include "seqpar/cuda/flash.hpp"
#include "seqpar/cuda/slices.hpp"

// Inside namespace seqpar, not `using namespace seqpar`: at global scope `cuda::` would be ambiguous
// between seqpar::cuda and libcu++'s ::cuda.
namespace seqpar::test {
namespace {

namespace cd = seqpar::cuda::detail;

template <class T>
T to_t(float x) {
  return cd::from_float<T>(x);
}
template <class T>
double to_d(T x) {
  return static_cast<double>(cd::to_float(x));
}

template <class T>
constexpr double tolerance() {
  return std::is_same_v<T, float> ? 1e-4 : 2.5e-2;
}

/// Max |got - want| over max |want| (1 when want is all zero).
double relative_error(const std::vector<double>& got, const std::vector<double>& want) {
  double err = 0, scale = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got[i]) != std::isnan(want[i])) return INFINITY;
    if (std::isinf(want[i]) || std::isinf(got[i])) {
      if (got[i] != want[i]) return INFINITY;
      continue;
    }
    err = std::max(err, std::abs(got[i] - want[i]));
    scale = std::max(scale, std::abs(want[i]));
  }
  return err / std::max(scale, 1.0);
}

struct Case {
  std::string name;
  std::int64_t q_rows, k_rows;
  std::vector<AttnSlice> slices;
};

template <class T>
struct DeviceTensor {
  std::vector<T> host;
  cuda::DeviceArray<T> dev;
  std::int64_t tokens;
  int heads, d;
  DeviceTensor(std::int64_t t, int h, int d_, std::mt19937& rng, float scale)
      : host(static_cast<std::size_t>(t * h * d_)), tokens(t), heads(h), d(d_) {
    std::normal_distribution<float> dist(0.0f, scale);
    for (auto& x : host) x = to_t<T>(dist(rng));
    dev = cuda::DeviceArray<T>(host);
  }
  ThdView<T> view() { return ThdView<T>::dense(dev.data(), tokens, heads, d); }
  ThdTensor<double> as_double() const {
    ThdTensor<double> out(tokens, heads, d);
    for (std::size_t i = 0; i < host.size(); ++i) out.storage[i] = to_d(host[i]);
    return out;
  }
  std::vector<double> download() const {
    const auto h = dev.to_host();
    std::vector<double> out(h.size());
    for (std::size_t i = 0; i < h.size(); ++i) out[i] = to_d(h[i]);
    return out;
  }
};

/// Runs forward and backward of `c` on CudaFlash<T> and on the fp64 reference; returns the errors.
template <class T>
void check_case(const Case& c, AttentionShape shape, std::uint32_t seed) {
  CAPTURE(c.name);
  CAPTURE(shape.heads_q);
  CAPTURE(shape.heads_kv);
  CAPTURE(shape.head_dim);
  std::mt19937 rng(seed);
  const int d = shape.head_dim;
  DeviceTensor<T> q(c.q_rows, shape.heads_q, d, rng, 1.0f), k(c.k_rows, shape.heads_kv, d, rng, 1.0f),
      v(c.k_rows, shape.heads_kv, d, rng, 1.0f), dout(c.q_rows, shape.heads_q, d, rng, 1.0f);
  // dQ, dK, dV start from random values: the kernel adds.
  DeviceTensor<T> dq(c.q_rows, shape.heads_q, d, rng, 0.5f), dk(c.k_rows, shape.heads_kv, d, rng, 0.5f),
      dv(c.k_rows, shape.heads_kv, d, rng, 0.5f);
  DeviceTensor<T> o(c.q_rows, shape.heads_q, d, rng, 1.0f);
  cuda::DeviceArray<float> lse(static_cast<std::size_t>(shape.heads_q * c.q_rows));
  const cuda::DeviceSlices slices(c.slices, c.q_rows, c.k_rows);

  attention::CudaFlash<T> flash;
  cuda::DeviceBytes ws(flash.workspace_bytes(shape, c.q_rows, c.k_rows));
  const LseView<float> lse_view = LseView<float>::dense(lse.data(), shape.heads_q, c.q_rows);
  flash.forward(shape, q.view(), k.view(), v.view(), slices.device(), o.view(), lse_view, ws.span());
  // Backward from the kernel's own O and LSE (as training does); the reference uses the same O.
  flash.backward(shape, q.view(), k.view(), v.view(), o.view(), lse_view, dout.view(), slices.device(), dq.view(),
                 dk.view(), dv.view(), ws.span());
  flash.exec().synchronize();

  // fp64 reference on the same (rounded) inputs.
  const auto qd = q.as_double(), kd = k.as_double(), vd = v.as_double(), dod = dout.as_double();
  ThdTensor<double> o_ref(c.q_rows, shape.heads_q, d);
  LseTensor<double> lse_ref(shape.heads_q, c.q_rows);
  attention::Reference<double> ref;
  ref.forward(shape, qd.view(), kd.view(), vd.view(), c.slices, o_ref.view(), lse_ref.view());
  const std::vector<double> o_got = o.download();
  std::vector<double> lse_got;
  for (float x : lse.to_host()) lse_got.push_back(x);
  CHECK(relative_error(o_got, o_ref.storage) <= tolerance<T>());
  CHECK(relative_error(lse_got, lse_ref.storage) <= tolerance<T>());

  // The reference backward from the kernel's own O (rounded to T) and the reference LSE.
  ThdTensor<double> o_used(c.q_rows, shape.heads_q, d);
  o_used.storage = o_got;
  auto dq_ref = dq.as_double(), dk_ref = dk.as_double(), dv_ref = dv.as_double();
  ref.backward(shape, qd.view(), kd.view(), vd.view(), o_used.view(), lse_ref.view(), dod.view(), c.slices,
               dq_ref.view(), dk_ref.view(), dv_ref.view());
  CHECK(relative_error(dq.download(), dq_ref.storage) <= tolerance<T>());
  CHECK(relative_error(dk.download(), dk_ref.storage) <= tolerance<T>());
  CHECK(relative_error(dv.download(), dv_ref.storage) <= tolerance<T>());
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (std::int64_t n : {1, 7, 1111}) {
    out.push_back({"causal " + std::to_string(n), n, n, {{{0, n}, {0, n}, Mask::causal()}}});
    out.push_back({"full " + std::to_string(n), n, n, {{{0, n}, {0, n}, Mask::full()}}});
  }
  out.push_back({"sliding window 37", 300, 300, {{{0, 300}, {0, 300}, Mask::sliding_window(37)}}});
  out.push_back({"causal offset +50 (queries after their keys)", 130, 180, {{{0, 130}, {0, 180}, Mask::causal(50)}}});
  out.push_back(
      {"causal offset -20 (first 20 rows fully masked)", 150, 150, {{{0, 150}, {0, 150}, Mask::causal(-20)}}});
  out.push_back({"rows in no slice and an empty key range",
                 200,
                 200,
                 {{{10, 60}, {0, 60}, Mask::causal(-10)}, {{90, 120}, {150, 150}, Mask::causal()}}});
  out.push_back({"two query slices reading the same keys",
                 200,
                 100,
                 {{{0, 90}, {0, 100}, Mask::full()}, {{100, 200}, {0, 100}, Mask::causal(-5)}}});
  DocumentBatch ones({std::vector<std::int64_t>(40, 1)});
  out.push_back({"documents of length 1", 40, 40, ones.document_causal_slices()});
  DocumentBatch mix({{300, 1, 7, 700, 64, 65}, {129, 1, 1000}});
  out.push_back(
      {"packed documents, two sequences", mix.total_tokens(), mix.total_tokens(), mix.document_causal_slices()});
  return out;
}

template <class T>
void run_all(std::initializer_list<AttentionShape> shapes) {
  std::uint32_t seed = 1;
  for (const AttentionShape& shape : shapes)
    for (const Case& c : cases()) check_case<T>(c, shape, seed++);
}

}  // namespace

TEST_SUITE("cuda") {
  TEST_CASE("CudaFlash<float> matches fp64 at 1e-4 (d 64 and 128, MHA and GQA)") {
    run_all<float>({{2, 2, 64, 0}, {4, 1, 128, 0}});
  }
  TEST_CASE("CudaFlash<__nv_bfloat16> matches fp64 at 2.5e-2") {
    run_all<__nv_bfloat16>({{4, 2, 128, 0}, {2, 2, 64, 0}});
  }
  TEST_CASE("CudaFlash<__half> matches fp64 at 2.5e-2") {
    run_all<__half>({{4, 2, 64, 0.05}});
  }

  TEST_CASE("the backward is bitwise reproducible") {
    const AttentionShape shape{4, 2, 128, 0};
    DocumentBatch mix({{300, 1, 7, 700, 64, 65}});
    const std::int64_t n = mix.total_tokens();
    std::mt19937 rng(3);
    DeviceTensor<__nv_bfloat16> q(n, 4, 128, rng, 1), k(n, 2, 128, rng, 1), v(n, 2, 128, rng, 1), o(n, 4, 128, rng, 1),
        dout(n, 4, 128, rng, 1);
    cuda::DeviceArray<float> lse(static_cast<std::size_t>(4 * n));
    const auto lse_view = LseView<float>::dense(lse.data(), 4, n);
    const cuda::DeviceSlices slices(mix.document_causal_slices(), n, n);
    attention::CudaFlash<__nv_bfloat16> flash;
    cuda::DeviceBytes ws(flash.workspace_bytes(shape, n, n));
    flash.forward(shape, q.view(), k.view(), v.view(), slices.device(), o.view(), lse_view, ws.span());
    std::vector<std::vector<__nv_bfloat16>> runs;
    for (int r = 0; r < 2; ++r) {
      DeviceTensor<__nv_bfloat16> dq(n, 4, 128, rng, 0), dk(n, 2, 128, rng, 0), dv(n, 2, 128, rng, 0);
      flash.backward(shape, q.view(), k.view(), v.view(), o.view(), lse_view, dout.view(), slices.device(), dq.view(),
                     dk.view(), dv.view(), ws.span());
      std::vector<__nv_bfloat16> all = dq.dev.to_host();
      for (const auto& t : {dk.dev.to_host(), dv.dev.to_host()}) all.insert(all.end(), t.begin(), t.end());
      runs.push_back(all);
    }
    REQUIRE(runs[0].size() == runs[1].size());
    CHECK(std::memcmp(runs[0].data(), runs[1].data(), runs[0].size() * sizeof(__nv_bfloat16)) == 0);
  }

  TEST_CASE("the device tile table equals the host reference (scan + radix sort, longest first)") {
    DocumentBatch mix({{300, 1, 7, 700, 64, 65, 2000}, {129, 1, 1000}});
    const std::int64_t n = mix.total_tokens();
    const auto host = mix.document_causal_slices();
    const cuda::DeviceSlices slices(host, n, n);
    for (int rows : {32, 64}) {
      const int num = static_cast<int>(cd::max_tiles(n, static_cast<std::int64_t>(host.size()), rows));
      const cd::TileTableLayout layout(static_cast<int>(n), num,
                                       cd::TileTableLayout::cub_bytes(static_cast<int>(n), num, "test"));
      cuda::DeviceBytes region(layout.bytes);
      const cuda::CudaExec exec;
      const auto table = cd::build_tile_table(slices.device().data(), static_cast<int>(host.size()), rows, num, layout,
                                              region.data(), exec.stream(), "test");
      exec.synchronize();
      unsigned length = 0;
      REQUIRE(cudaMemcpy(&length, table.length, sizeof(unsigned), cudaMemcpyDeviceToHost) == cudaSuccess);
      std::vector<std::uint64_t> tiles(length);
      REQUIRE(cudaMemcpy(tiles.data(), table.tiles, length * sizeof(std::uint64_t), cudaMemcpyDeviceToHost) ==
              cudaSuccess);
      const auto want = cd::tile_table_reference({slices.host().begin(), slices.host().end()}, rows);
      REQUIRE(length == want.size());
      for (std::size_t i = 0; i < want.size(); ++i) CHECK(tiles[i] == want[i].tile);
    }
  }

  TEST_CASE("with prepared Params (a host-built tile table, once) the results are the per-call path's, bit for bit") {
    const AttentionShape shape{4, 2, 128, 0};
    DocumentBatch mix({{300, 1, 7, 700, 64, 65}, {129, 1, 1000}});
    const std::int64_t n = mix.total_tokens();
    std::mt19937 rng(9);
    DeviceTensor<__nv_bfloat16> q(n, 4, 128, rng, 1), k(n, 2, 128, rng, 1), v(n, 2, 128, rng, 1),
        dout(n, 4, 128, rng, 1);
    const cuda::DeviceSlices slices(mix.document_causal_slices(), n, n);
    attention::CudaFlash<__nv_bfloat16> flash;
    cuda::DeviceBytes ws(flash.workspace_bytes(shape, n, n));
    const auto fwd = flash.prepare(flash.exec(), shape, slices.host(), n, n, attention::Pass::kForward);
    const auto bwd = flash.prepare(flash.exec(), shape, slices.host(), n, n, attention::Pass::kBackward);
    CHECK(fwd.num_tiles > 0);
    std::vector<std::vector<__nv_bfloat16>> runs;
    for (int prepared = 0; prepared < 2; ++prepared) {
      DeviceTensor<__nv_bfloat16> o(n, 4, 128, rng, 0), dq(n, 4, 128, rng, 0), dk(n, 2, 128, rng, 0),
          dv(n, 2, 128, rng, 0);
      cuda::DeviceArray<float> lse(static_cast<std::size_t>(4 * n));
      const auto lse_view = LseView<float>::dense(lse.data(), 4, n);
      if (prepared == 1) {
        flash.forward(flash.exec(), fwd, shape, q.view(), k.view(), v.view(), slices.device(), o.view(), lse_view,
                      ws.span());
        flash.backward(flash.exec(), bwd, shape, q.view(), k.view(), v.view(), o.view(), lse_view, dout.view(),
                       slices.device(), dq.view(), dk.view(), dv.view(), ws.span());
      } else {
        flash.forward(shape, q.view(), k.view(), v.view(), slices.device(), o.view(), lse_view, ws.span());
        flash.backward(shape, q.view(), k.view(), v.view(), o.view(), lse_view, dout.view(), slices.device(), dq.view(),
                       dk.view(), dv.view(), ws.span());
      }
      flash.exec().synchronize();
      std::vector<__nv_bfloat16> all = o.dev.to_host();
      for (const auto& t : {dq.dev.to_host(), dk.dev.to_host(), dv.dev.to_host()})
        all.insert(all.end(), t.begin(), t.end());
      runs.push_back(all);
    }
    REQUIRE(runs[0].size() == runs[1].size());
    CHECK(std::memcmp(runs[0].data(), runs[1].data(), runs[0].size() * sizeof(__nv_bfloat16)) == 0);
    // Params of another call are refused by name.
    try {
      DeviceTensor<__nv_bfloat16> o(n, 4, 128, rng, 0);
      cuda::DeviceArray<float> lse(static_cast<std::size_t>(4 * n));
      flash.forward(flash.exec(), bwd, shape, q.view(), k.view(), v.view(), slices.device(), o.view(),
                    LseView<float>::dense(lse.data(), 4, n), ws.span());
      FAIL("backward Params accepted by a forward call");
    } catch (const std::invalid_argument& e) {
      CHECK(std::string(e.what()).find("params.pass") != std::string::npos);
    }
  }

  TEST_CASE("bad arguments are named") {
    attention::CudaFlash<float> flash;
    const AttentionShape bad{2, 2, 96, 0};
    cuda::DeviceArray<float> x(static_cast<std::size_t>(8 * 2 * 96));
    const auto view = ThdView<const float>::dense(x.data(), 8, 2, 96);
    cuda::DeviceArray<float> l(16);
    try {
      flash.forward(bad, view, view, view, {}, ThdView<float>::dense(x.data(), 8, 2, 96),
                    LseView<float>::dense(l.data(), 2, 8), {});
      FAIL("head_dim 96 was accepted");
    } catch (const std::invalid_argument& e) {
      CHECK(std::string(e.what()).find("shape.head_dim") != std::string::npos);
      // can_implement refuses it in the same words.
      const Status s = flash.can_implement(bad);
      CHECK_FALSE(s);
      CHECK(s.reason.substr(s.reason.find(": ")) == std::string(e.what()).substr(std::string(e.what()).find(": ")));
    }
    // Both built head dims fit this device's shared memory (can_implement asks it through the context).
    CHECK(flash.can_implement({2, 2, 64, 0}));
    CHECK(flash.can_implement({2, 2, 128, 0}));
    CHECK(attention::CudaFlash<float>::shared_bytes(128) <= static_cast<std::size_t>(flash.exec().max_shared_bytes()));
    const AttentionShape shape{2, 2, 64, 0};
    cuda::DeviceArray<float> y(static_cast<std::size_t>(8 * 2 * 64));
    const auto v64 = ThdView<const float>::dense(y.data(), 8, 2, 64);
    try {
      flash.forward(shape, v64, v64, v64, {}, ThdView<float>::dense(y.data(), 8, 2, 64),
                    LseView<float>::dense(l.data(), 2, 8), {});
      FAIL("an empty workspace was accepted");
    } catch (const std::invalid_argument& e) {
      CHECK(std::string(e.what()).find("workspace.size()") != std::string::npos);
    }
  }
}

}  // namespace seqpar::test
