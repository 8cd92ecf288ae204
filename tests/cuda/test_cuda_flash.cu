// SPDX-License-Identifier: Apache-2.0
// What is CudaFlash's own (kernels/seqpar/gpu/flash.hpp): the backward bitwise reproducible; the device
// tile table equal to the host reference; head sizes the kernels are not built for and an empty workspace
// refused by name, MLA's 192/128 accepted. The comparisons with the fp64 reference are the shared kernel conformance
// cases (tests/cuda/test_cuda_kernel_cases.cpp). Runs only with a CUDA device (the main exits 77 otherwise). A .cu for
// the tile table's device code (detail/tile_table.cuh); CudaFlash itself comes compiled from seqpar::cuda_instances
// (flash.hpp here, not flash.cuh).
#include <doctest/doctest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "seqpar/core/document_batch.hpp"
#include "seqpar/gpu/detail/tile_table.cuh"
#include "seqpar/gpu/device_memory.hpp"
#include "seqpar/gpu/flash.hpp"
#include "seqpar/gpu/slices.hpp"

namespace seqpar::test {
namespace {

namespace cd = seqpar::gpu::detail;

template <class T>
T to_t(float x) {
  return cd::from_float<T>(x);
}

template <class T>
struct DeviceTensor {
  std::vector<T> host;
  gpu::DeviceArray<T> dev;
  std::int64_t tokens;
  int heads, d;
  DeviceTensor(std::int64_t t, int h, int d_, std::mt19937& rng, float scale)
      : host(static_cast<std::size_t>(t * h * d_)), tokens(t), heads(h), d(d_) {
    std::normal_distribution<float> dist(0.0f, scale);
    for (auto& x : host) x = to_t<T>(dist(rng));
    dev = gpu::DeviceArray<T>(host);
  }
  ThdView<T> view() { return ThdView<T>::dense(dev.data(), tokens, heads, d); }
};

/// Two backward calls on the same inputs give the same bits (bf16, 4:2 GQA, documents), at head sizes d/d_v.
void check_backward_reproducible(int d, int d_v) {
  const AttentionShape shape{4, 2, d, 0, d_v};
  DocumentBatch mix({{300, 1, 7, 700, 64, 65}});
  const std::int64_t n = mix.total_tokens();
  std::mt19937 rng(3);
  DeviceTensor<__nv_bfloat16> q(n, 4, d, rng, 1), k(n, 2, d, rng, 1), v(n, 2, d_v, rng, 1), o(n, 4, d_v, rng, 1),
      dout(n, 4, d_v, rng, 1);
  gpu::DeviceArray<float> lse(static_cast<std::size_t>(4 * n));
  const auto lse_view = LseView<float>::dense(lse.data(), 4, n);
  const gpu::DeviceSlices slices(mix.document_causal_slices(), n, n);
  attention::CudaFlash<__nv_bfloat16> flash;
  gpu::DeviceBytes ws(flash.workspace_bytes(shape, n, n));
  flash.forward(shape, q.view(), k.view(), v.view(), slices.device(), o.view(), lse_view, ws.span());
  std::vector<std::vector<__nv_bfloat16>> runs;
  for (int r = 0; r < 2; ++r) {
    DeviceTensor<__nv_bfloat16> dq(n, 4, d, rng, 0), dk(n, 2, d, rng, 0), dv(n, 2, d_v, rng, 0);
    flash.backward(shape, q.view(), k.view(), v.view(), o.view(), lse_view, dout.view(), slices.device(), dq.view(),
                   dk.view(), dv.view(), ws.span());
    std::vector<__nv_bfloat16> all = dq.dev.to_host();
    for (const auto& t : {dk.dev.to_host(), dv.dev.to_host()}) all.insert(all.end(), t.begin(), t.end());
    runs.push_back(all);
  }
  REQUIRE(runs[0].size() == runs[1].size());
  CHECK(std::memcmp(runs[0].data(), runs[1].data(), runs[0].size() * sizeof(__nv_bfloat16)) == 0);
}

}  // namespace

TEST_SUITE("cuda") {
  TEST_CASE("the backward is bitwise reproducible, at 128/128 and MLA's 192/128") {
    check_backward_reproducible(128, 128);
    check_backward_reproducible(192, 128);
  }

  TEST_CASE("the device tile table equals the host reference (scan + radix sort, longest first)") {
    DocumentBatch mix({{300, 1, 7, 700, 64, 65, 2000}, {129, 1, 1000}});
    const std::int64_t n = mix.total_tokens();
    const auto host = mix.document_causal_slices();
    const gpu::DeviceSlices slices(host, n, n);
    for (int rows : {32, 64}) {
      const int num = static_cast<int>(cd::max_tiles(n, static_cast<std::int64_t>(host.size()), rows));
      const cd::TileTableLayout layout(static_cast<int>(n), num,
                                       cd::TileTableLayout::cub_bytes(static_cast<int>(n), num, "test"));
      gpu::DeviceBytes region(layout.bytes);
      const gpu::CudaExec exec;
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
    const gpu::DeviceSlices slices(mix.document_causal_slices(), n, n);
    attention::CudaFlash<__nv_bfloat16> flash;
    gpu::DeviceBytes ws(flash.workspace_bytes(shape, n, n));
    const auto fwd = flash.prepare(flash.exec(), shape, slices.host(), n, n, attention::Pass::kForward);
    const auto bwd = flash.prepare(flash.exec(), shape, slices.host(), n, n, attention::Pass::kBackward);
    CHECK(fwd.num_tiles > 0);
    std::vector<std::vector<__nv_bfloat16>> runs;
    for (int prepared = 0; prepared < 2; ++prepared) {
      DeviceTensor<__nv_bfloat16> o(n, 4, 128, rng, 0), dq(n, 4, 128, rng, 0), dk(n, 2, 128, rng, 0),
          dv(n, 2, 128, rng, 0);
      gpu::DeviceArray<float> lse(static_cast<std::size_t>(4 * n));
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
      gpu::DeviceArray<float> lse(static_cast<std::size_t>(4 * n));
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
    gpu::DeviceArray<float> x(static_cast<std::size_t>(8 * 2 * 96));
    const auto view = ThdView<const float>::dense(x.data(), 8, 2, 96);
    gpu::DeviceArray<float> l(16);
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
    // The built head sizes fit this device's shared memory (can_implement asks it through the context),
    // MLA's 192/128 included, with head_dim_v 0 or written out.
    CHECK(flash.can_implement({2, 2, 64, 0}));
    CHECK(flash.can_implement({2, 2, 128, 0}));
    CHECK(flash.can_implement({2, 2, 128, 0, 128}));
    CHECK(flash.can_implement({2, 2, 192, 0, 128}));
    for (const attention::CudaFlashHeadDims d : attention::kCudaFlashHeadDims) {
      CAPTURE(d.qk);
      CAPTURE(d.v);
      CHECK(attention::CudaFlash<float>::shared_bytes(d.qk, d.v) <=
            static_cast<std::size_t>(flash.exec().max_shared_bytes()));
      CHECK(attention::CudaFlash<__nv_bfloat16>::shared_bytes(d.qk, d.v) <=
            static_cast<std::size_t>(flash.exec().max_shared_bytes()));
    }
    // A pair they are not built for: a q/k size of a pair with another v size names head_dim_v, a q/k size of
    // none names head_dim.
    const Status v_other = flash.can_implement({2, 2, 128, 0, 64});
    CHECK_FALSE(v_other);
    CHECK(v_other.reason.find("shape.head_dim_v = 64") != std::string::npos);
    CHECK(v_other.reason.find("192/128") != std::string::npos);
    const Status v_same = flash.can_implement({2, 2, 192, 0, 0});  // 192/192
    CHECK_FALSE(v_same);
    CHECK(v_same.reason.find("shape.head_dim_v = 0") != std::string::npos);
    const Status qk_other = flash.can_implement({2, 2, 96, 0, 64});
    CHECK_FALSE(qk_other);
    CHECK(qk_other.reason.find("shape.head_dim = 96") != std::string::npos);
    CHECK_THROWS_AS(static_cast<void>(attention::CudaFlash<float>::shared_bytes(96, 64)), std::invalid_argument);
    // At 192/128 v is 128 wide: a v of q/k's 192 is refused by name.
    {
      const AttentionShape mla{2, 2, 192, 0, 128};
      gpu::DeviceArray<float> wide(static_cast<std::size_t>(8 * 2 * 192));
      const auto qk = ThdView<const float>::dense(wide.data(), 8, 2, 192);
      gpu::DeviceArray<float> narrow(static_cast<std::size_t>(8 * 2 * 128));
      try {
        flash.forward(mla, qk, qk, qk, {}, ThdView<float>::dense(narrow.data(), 8, 2, 128),
                      LseView<float>::dense(l.data(), 2, 8), {});
        FAIL("a v of 192 values per head was accepted at 192/128");
      } catch (const std::invalid_argument& e) {
        CHECK(std::string(e.what()).find("v.head_dim = 192") != std::string::npos);
      }
    }
    const AttentionShape shape{2, 2, 64, 0};
    gpu::DeviceArray<float> y(static_cast<std::size_t>(8 * 2 * 64));
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
