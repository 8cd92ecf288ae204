// SPDX-License-Identifier: Apache-2.0
// Chunked attention (DPP: a long document split across chunks, the K/V prefix carried) on one GPU:
// runtime::ChunkedAttention<CudaFlash<float>> on CudaExec, 1, 2 and 4 ranks sharing the GPU, over an
// all-to-all, a ring and a sharding-aware all-gather strategy; every chunk's forward, then every
// backward in reverse, gathered and compared with the fp64 reference over the whole batch (fp32: 1e-4
// of the largest reference value, as test_cuda_strategies measures), and each call's prefix bytes as
// counted by the transport equal to what its program declares. Skipped without a GPU.
#include <doctest/doctest.h>

#include <seqpar/schedule/dynamic_chunk.hpp>
#include <seqpar/seqpar.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <random>
#include <vector>

#include "seqpar/cuda/check.hpp"
#include "seqpar/cuda/data_ops.hpp"
#include "seqpar/cuda/device_memory.hpp"
#include "seqpar/cuda/device_world.hpp"
#include "seqpar/cuda/exec.hpp"
#include "seqpar/cuda/flash.hpp"
#include "support/distributed_check.hpp"

// Inside namespace seqpar: at global scope `cuda` would be ambiguous (seqpar::cuda, libcu++'s ::cuda).
namespace seqpar {
namespace {

using Kernel = attention::CudaFlash<float>;

double relative_error(const std::vector<double>& got, const std::vector<double>& want) {
  double scale = 0, e = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    if (std::isfinite(want[i])) scale = std::max(scale, std::abs(want[i]));
    if (std::isnan(got[i]) || std::isinf(want[i]) || std::isinf(got[i])) {
      if (!(want[i] == got[i])) e = INFINITY;
    } else {
      e = std::max(e, std::abs(got[i] - want[i]));
    }
  }
  return scale > 0 ? e / scale : e;
}

template <class S>
test::Errors check_chunked_on_gpu(int world, typename S::Arguments args) {
  const AttentionShape shape{4, 2, 64};
  const int d = shape.head_dim;
  const DocumentBatch batch({{300, 9, 21, 40}, {17, 120, 3}});
  const std::vector<Chunk> chunks =
      schedule::DynamicChunk{{.token_capacity = 128, .time_target = 0, .slices = 0, .cost = {}}}.chunks(batch);
  const std::int64_t n = batch.total_tokens();
  std::mt19937 rng(static_cast<std::uint32_t>(world) + 5);
  std::normal_distribution<double> normal(0.0, 1.0);
  const auto fill = [&](ThdTensor<double>& t) {
    for (double& x : t.storage) x = static_cast<double>(static_cast<float>(normal(rng)));
  };
  ThdTensor<double> q(n, shape.heads_q, d), k(n, shape.heads_kv, d), v(n, shape.heads_kv, d), dout(n, shape.heads_q, d);
  fill(q), fill(k), fill(v), fill(dout);
  ThdTensor<double> o_ref(n, shape.heads_q, d), dq_ref(n, shape.heads_q, d), dk_ref(n, shape.heads_kv, d),
      dv_ref(n, shape.heads_kv, d);
  LseTensor<double> lse_ref(shape.heads_q, n);
  const attention::Reference<double> ref;
  const auto slices = batch.document_causal_slices();
  ref.forward(shape, q.view(), k.view(), v.view(), slices, o_ref.view(), lse_ref.view());
  ref.backward(shape, q.view(), k.view(), v.view(), o_ref.view(), lse_ref.view(), dout.view(), slices, dq_ref.view(),
               dk_ref.view(), dv_ref.view());
  ThdTensor<double> o_got(n, shape.heads_q, d), dq_got(n, shape.heads_q, d), dk_got(n, shape.heads_kv, d),
      dv_got(n, shape.heads_kv, d);
  LseTensor<double> lse_got(shape.heads_q, n);
  test::Errors err;
  std::mutex mu;
  cuda::device_world(world).run([&](backend::inproc::Transport& transport) {
    SEQPAR_CUDA_CHECK(cudaSetDevice(0), "rank");
    DistributedAttention<S, Kernel> attn(transport, shape, args, Kernel{});
    runtime::ChunkedAttention<Kernel> chunked(attn, transport);
    chunked.begin(chunks);
    const cuda::CudaExec& exec = attn.exec();
    const int nc = chunked.num_chunks();
    struct Local {
      cuda::DeviceArray<float> q, k, v, o, dout, dq, dk, dv, lse;
      std::int64_t rows = 0;
    };
    std::vector<Local> loc(static_cast<std::size_t>(nc));
    // Chunk c's local rows of a global tensor, uploaded on the rank's stream.
    const auto gather = [&](int c, const ThdTensor<double>& g) {
      std::vector<float> l;
      for (const Range& r : chunked.owned_global(c))
        for (std::int64_t t = r.begin; t < r.end; ++t)
          for (int h = 0; h < g.heads; ++h)
            for (int x = 0; x < d; ++x) l.push_back(static_cast<float>(g.view()(t, h, x)));
      cuda::DeviceArray<float> dev(l.size());
      if (!l.empty())
        SEQPAR_CUDA_CHECK(cudaMemcpy(dev.data(), l.data(), l.size() * sizeof(float), cudaMemcpyHostToDevice), "up");
      return dev;
    };
    const auto view = [&](const Local& l, const cuda::DeviceArray<float>& a, int heads) {
      return ThdView<float>::dense(a.data(), l.rows, heads, d);
    };
    bool bytes_ok = true;
    for (int c = 0; c < nc; ++c) {
      Local& l = loc[static_cast<std::size_t>(c)];
      l.rows = chunked.local_tokens(c);
      l.q = gather(c, q), l.k = gather(c, k), l.v = gather(c, v), l.dout = gather(c, dout);
      const auto rq = static_cast<std::size_t>(l.rows * shape.heads_q * d);
      const auto rk = static_cast<std::size_t>(l.rows * shape.heads_kv * d);
      l.o = cuda::DeviceArray<float>(rq), l.dq = cuda::DeviceArray<float>(rq);
      l.dk = cuda::DeviceArray<float>(rk), l.dv = cuda::DeviceArray<float>(rk);
      l.lse = cuda::DeviceArray<float>(static_cast<std::size_t>(l.rows * shape.heads_q));
      chunked.forward(c, view(l, l.q, shape.heads_q), view(l, l.k, shape.heads_kv), view(l, l.v, shape.heads_kv),
                      view(l, l.o, shape.heads_q), LseView<float>::dense(l.lse.data(), shape.heads_q, l.rows));
      bytes_ok =
          bytes_ok && chunked.last_bytes_sent() == chunked.program(c, 0).bytes_sent(sizeof(float), sizeof(float));
    }
    for (int c = nc - 1; c >= 0; --c) {
      Local& l = loc[static_cast<std::size_t>(c)];
      chunked.backward(c, view(l, l.q, shape.heads_q), view(l, l.k, shape.heads_kv), view(l, l.v, shape.heads_kv),
                       view(l, l.o, shape.heads_q), LseView<const float>::dense(l.lse.data(), shape.heads_q, l.rows),
                       view(l, l.dout, shape.heads_q), view(l, l.dq, shape.heads_q), view(l, l.dk, shape.heads_kv),
                       view(l, l.dv, shape.heads_kv));
      bytes_ok =
          bytes_ok && chunked.last_bytes_sent() == chunked.program(c, 2).bytes_sent(sizeof(float), sizeof(float));
    }
    exec.synchronize();
    const std::lock_guard lock(mu);
    err.bytes_match = err.bytes_match && bytes_ok;
    for (int c = 0; c < nc; ++c) {
      const Local& l = loc[static_cast<std::size_t>(c)];
      const auto ho = l.o.to_host(), hdq = l.dq.to_host(), hdk = l.dk.to_host(), hdv = l.dv.to_host();
      const auto hlse = l.lse.to_host();
      std::int64_t row = 0;
      for (const Range& r : chunked.owned_global(c))
        for (std::int64_t t = r.begin; t < r.end; ++t, ++row) {
          for (int h = 0; h < shape.heads_q; ++h) {
            lse_got.view()(h, t) = hlse[static_cast<std::size_t>(h * l.rows + row)];
            for (int x = 0; x < d; ++x) {
              const auto at = static_cast<std::size_t>((row * shape.heads_q + h) * d + x);
              o_got.view()(t, h, x) = ho[at];
              dq_got.view()(t, h, x) = hdq[at];
            }
          }
          for (int h = 0; h < shape.heads_kv; ++h)
            for (int x = 0; x < d; ++x) {
              const auto at = static_cast<std::size_t>((row * shape.heads_kv + h) * d + x);
              dk_got.view()(t, h, x) = hdk[at];
              dv_got.view()(t, h, x) = hdv[at];
            }
        }
    }
  });
  err.o = relative_error(o_got.storage, o_ref.storage);
  err.lse = relative_error(lse_got.storage, lse_ref.storage);
  err.dq = relative_error(dq_got.storage, dq_ref.storage);
  err.dk = relative_error(dk_got.storage, dk_ref.storage);
  err.dv = relative_error(dv_got.storage, dv_ref.storage);
  return err;
}

}  // namespace
}  // namespace seqpar

TEST_SUITE("cuda") {
  TEST_CASE("ChunkedAttention<CudaFlash<float>> on one GPU equals attention over the whole batch") {
    using namespace seqpar;
    for (int world : {1, 2, 4}) {
      CAPTURE(world);
      const auto a2a = check_chunked_on_gpu<Strategy<partition::Uniform, comm::AllToAll>>(world, {});
      CHECK(a2a.max() < 1e-4);
      CHECK(a2a.bytes_match);
      const auto ring = check_chunked_on_gpu<Strategy<partition::Zigzag, comm::Ring>>(world, {});
      CHECK(ring.max() < 1e-4);
      CHECK(ring.bytes_match);
      Strategy<partition::PerDoc, comm::AllGather>::Arguments aware;
      aware.comm.sharding_aware = true;
      const auto gather = check_chunked_on_gpu<Strategy<partition::PerDoc, comm::AllGather>>(world, aware);
      CHECK(gather.max() < 1e-4);
      CHECK(gather.bytes_match);
    }
  }
}
