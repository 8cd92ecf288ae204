// SPDX-License-Identifier: Apache-2.0
// 07: Zigzag ring attention (sharding-aware) over NCCL, one process per GPU.
//
// Example 06 on GPUs: the same strategy with the CUDA kernel for fp32 (attention::CudaFlash<float>; in
// fp16/bf16 use attention::DefaultCudaKernel<T>, kernels/seqpar/gpu/default_kernel.hpp: cuDNN's fused
// attention, CudnnSdpa, where seqpar::cudnn is built, else CudaFlash) on device
// buffers, its KV blocks moved by seqpar::backend::nccl::Transport on the execution context's comm
// stream while the compute stream runs attention (events order the two; nothing waits on the host
// inside the ring). Every rank builds the same batch and inputs (fixed seed), uploads only its shard
// (zigzag chunks r and 2P-1-r), runs forward and backward, and rank 0 gathers O and dQ through the
// NCCL transport (all_gather_v on device memory) and compares them with the fp64 reference over the
// whole batch. `t.synchronize()` is where a rank learns, under the transport's deadline, that its
// transfers finished or that a peer failed (never a hang).
//   usage: mpiexec -n P 07_nccl_ring [--smoke] [--tokens T]   (one rank per GPU; built with MPI)
//          07_nccl_ring [--smoke] [--tokens T]                (one GPU: a world of one rank)
#include <seqpar/backend/nccl.hpp>
#include <seqpar/seqpar.hpp>
#if SEQPAR_ENABLE_MPI
#include <seqpar/backend/mpi.hpp>
#endif

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "seqpar/gpu/check.hpp"
#include "seqpar/gpu/data_ops.hpp"
#include "seqpar/gpu/device_memory.hpp"
#include "seqpar/gpu/exec.hpp"
#include "seqpar/gpu/flash.hpp"

namespace sp = seqpar;
using ZigzagRing = sp::Strategy<sp::partition::Zigzag, sp::comm::Ring>;

namespace {

int run(sp::backend::nccl::Transport& t, std::int64_t tokens) {
  // One sequence of lognormal documents (median tokens/16) and random inputs, identical on every rank.
  std::mt19937 rng(2026);
  std::lognormal_distribution<double> doc_len(std::log(double(tokens) / 16), 1.0);
  std::vector<std::int64_t> docs;
  for (std::int64_t left = tokens; left > 0; left -= docs.back())
    docs.push_back(std::clamp<std::int64_t>(std::llround(doc_len(rng)), 1, left));
  const sp::DocumentBatch batch = sp::DocumentBatch::single(docs);
  const sp::AttentionShape shape{8, 2, 64};  // GQA 8:2, head_dim 64 (CudaFlash: 64, 128 or 192/128)
  const std::int64_t n = batch.total_tokens();
  sp::ThdTensor<float> q(n, shape.heads_q, shape.head_dim), k(n, shape.heads_kv, shape.head_dim),
      v(n, shape.heads_kv, shape.head_dim), dout(n, shape.heads_q, shape.head_dim);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (auto* x : {&q, &k, &v, &dout})
    for (float& e : x->storage) e = normal(rng);

  ZigzagRing::Arguments args;
  args.comm.sharding_aware = true;  // send each peer only the KV rows its slices read
  const sp::gpu::CudaExec exec(t.device());
  sp::DistributedAttention<ZigzagRing, sp::attention::CudaFlash<float>> attn(t, shape, args,
                                                                             sp::attention::CudaFlash<float>(exec));
  const auto& plan = attn.plan(batch);
  const std::int64_t local = attn.local_tokens(batch);
  const auto shard = [&](const sp::ThdTensor<float>& g) {  // (local tokens, heads, d) on the device
    std::vector<float> l(static_cast<std::size_t>(local * g.heads * g.head_dim));
    const std::int64_t row = std::int64_t{g.heads} * g.head_dim;
    std::int64_t at = 0;
    for (const sp::Range& r : attn.owned_ranges(batch))
      std::copy_n(g.storage.begin() + r.begin * row, r.size() * row, l.begin() + at * row), at += r.size();
    return sp::gpu::DeviceArray<float>(l);
  };
  const auto lq = shard(q), lk = shard(k), lv = shard(v), ldo = shard(dout);
  const auto q_elems = static_cast<std::size_t>(local * shape.heads_q * shape.head_dim);
  const auto kv_elems = static_cast<std::size_t>(local * shape.heads_kv * shape.head_dim);
  sp::gpu::DeviceArray<float> lo(q_elems), ldq(q_elems), ldk(kv_elems), ldv(kv_elems),
      llse(static_cast<std::size_t>(local * shape.heads_q));
  const auto view = [&](const sp::gpu::DeviceArray<float>& a, int heads) {
    return sp::ThdView<float>::dense(a.data(), local, heads, shape.head_dim);
  };
  attn.forward(batch, view(lq, shape.heads_q), view(lk, shape.heads_kv), view(lv, shape.heads_kv),
               view(lo, shape.heads_q), sp::LseView<float>::dense(llse.data(), shape.heads_q, local));
  const std::uint64_t forward_bytes = attn.last_bytes_sent();
  attn.backward(batch, view(lq, shape.heads_q), view(lk, shape.heads_kv), view(lv, shape.heads_kv),
                view(lo, shape.heads_q), sp::LseView<const float>::dense(llse.data(), shape.heads_q, local),
                view(ldo, shape.heads_q), view(ldq, shape.heads_q), view(ldk, shape.heads_kv),
                view(ldv, shape.heads_kv));
  const std::uint64_t backward_bytes = attn.last_bytes_sent();

  // Gather every rank's O and dQ on the device (rank order, each in its plan order), on the comm
  // stream after the compute that wrote them; then wait, under the deadline.
  const std::size_t row_bytes = sizeof(float) * static_cast<std::size_t>(shape.heads_q * shape.head_dim);
  std::vector<std::size_t> counts;
  for (int r = 0; r < t.size(); ++r) counts.push_back(static_cast<std::size_t>(plan.local_tokens(r)) * row_bytes);
  const auto total = static_cast<std::size_t>(n) * row_bytes / sizeof(float);
  sp::gpu::DeviceArray<float> all_o(total), all_dq(total);
  exec.comm_after_compute();
  t.set_queue(exec.comm_queue());
  t.all_gather_v(std::as_bytes(lo.span()), std::as_writable_bytes(all_o.span()), counts);
  t.all_gather_v(std::as_bytes(ldq.span()), std::as_writable_bytes(all_dq.span()), counts);
  t.synchronize();
  exec.synchronize();
  const std::uint64_t mine[2] = {forward_bytes, backward_bytes};
  std::vector<std::uint64_t> sent(2 * static_cast<std::size_t>(t.size()));
  t.all_gather(std::as_bytes(std::span<const std::uint64_t>(mine)), std::as_writable_bytes(std::span(sent)));
  if (t.rank() != 0) return 0;

  // Rows back at their tokens, then the fp64 reference over the whole batch.
  const auto placed = [&](const sp::gpu::DeviceArray<float>& gathered) {
    const std::vector<float> h = gathered.to_host();
    sp::ThdTensor<double> out(n, shape.heads_q, shape.head_dim);
    const std::int64_t row = std::int64_t{shape.heads_q} * shape.head_dim;
    std::int64_t at = 0;
    for (int r = 0; r < t.size(); ++r)
      for (const sp::Range& g : plan.owned[static_cast<std::size_t>(r)])
        std::copy_n(h.begin() + at * row, g.size() * row, out.storage.begin() + g.begin * row), at += g.size();
    return out;
  };
  const sp::ThdTensor<double> o = placed(all_o), dq = placed(all_dq);
  sp::ThdTensor<double> rq(n, shape.heads_q, shape.head_dim), rk(n, shape.heads_kv, shape.head_dim),
      rv(n, shape.heads_kv, shape.head_dim), rdo(n, shape.heads_q, shape.head_dim),
      ro(n, shape.heads_q, shape.head_dim), rdq(n, shape.heads_q, shape.head_dim),
      rdk(n, shape.heads_kv, shape.head_dim), rdv(n, shape.heads_kv, shape.head_dim);
  std::copy(q.storage.begin(), q.storage.end(), rq.storage.begin());
  std::copy(k.storage.begin(), k.storage.end(), rk.storage.begin());
  std::copy(v.storage.begin(), v.storage.end(), rv.storage.begin());
  std::copy(dout.storage.begin(), dout.storage.end(), rdo.storage.begin());
  sp::LseTensor<double> rlse(shape.heads_q, n);
  const sp::attention::Reference<double> ref;
  const auto slices = batch.document_causal_slices();
  ref.forward(shape, rq.view(), rk.view(), rv.view(), slices, ro.view(), rlse.view());
  ref.backward(shape, rq.view(), rk.view(), rv.view(), ro.view(), rlse.view(), rdo.view(), slices, rdq.view(),
               rdk.view(), rdv.view());
  const auto rel = [](const sp::ThdTensor<double>& want, const sp::ThdTensor<double>& got) {
    double err = 0, scale = 0;
    for (std::size_t i = 0; i < want.storage.size(); ++i) {
      scale = std::max(scale, std::abs(want.storage[i]));
      err = std::max(err, std::isfinite(got.storage[i]) ? std::abs(want.storage[i] - got.storage[i]) : INFINITY);
    }
    return err / scale;
  };
  const double o_err = rel(ro, o), dq_err = rel(rdq, dq);
  std::printf(
      "seqpar 07: sharding-aware zigzag ring over NCCL, %d ranks (GPUs), %lld tokens, %zu documents, "
      "heads %d:%d, d %d\n",
      t.size(), static_cast<long long>(n), docs.size(), shape.heads_q, shape.heads_kv, shape.head_dim);
  for (int r = 0; r < t.size(); ++r)
    std::printf("  rank %d: %lld tokens, forward sent %llu bytes, backward %llu\n", r,
                static_cast<long long>(plan.local_tokens(r)), static_cast<unsigned long long>(sent[2 * std::size_t(r)]),
                static_cast<unsigned long long>(sent[2 * std::size_t(r) + 1]));
  std::printf("vs fp64 reference: O max |err| / max |ref| = %.2e, dQ %.2e\n", o_err, dq_err);
  const bool ok = o_err < 1e-4 && dq_err < 1e-4;  // fp32 storage and accumulation
  std::printf("%s\n", ok ? "OK" : "FAILED: error above tolerance");
  return ok ? 0 : 1;
}

[[maybe_unused]] bool launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE"})
    if (std::getenv(v) != nullptr) return true;
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  std::int64_t tokens = 4096;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--smoke")
      tokens = 1024;
    else if (a == "--tokens" && i + 1 < argc)
      tokens = std::stoll(argv[++i]);
    else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  const int devices = sp::gpu::device_count();
#if SEQPAR_ENABLE_MPI
  if (launched_by_mpi()) {
    // The unique id travels over MPI; a rank that throws ends the job (run_or_abort) instead of
    // leaving its peers to their deadline.
    sp::backend::mpi::Environment env(argc, argv);
    return sp::backend::mpi::run_or_abort(MPI_COMM_WORLD, [&](sp::backend::mpi::Transport& host) {
      MPI_Comm node = MPI_COMM_NULL;
      MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
      int local = 0;
      MPI_Comm_rank(node, &local);
      MPI_Comm_free(&node);
      if (devices == 0) throw std::runtime_error("no CUDA device on this node");
      SEQPAR_CUDA_CHECK(cudaSetDevice(local % devices), "07_nccl_ring");
      auto t = sp::backend::nccl::Transport::bootstrap(host);
      return run(t, tokens);
    });
  }
#endif
  if (devices == 0) {
    std::printf("07_nccl_ring: no CUDA device (or driver) on this machine: skipped\n");
    return 77;
  }
  try {
    auto t = sp::backend::nccl::Transport::single();
    return run(t, tokens);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "seqpar: rank 0 failed: %s\n", e.what());
    return 1;
  }
}
