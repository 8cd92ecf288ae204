// SPDX-License-Identifier: Apache-2.0
// Transport-generic test bodies, written once and run on every transport (the in-process world in
// tests/backend/test_transport_cases_inproc.cpp, MPI in tests/mpi/test_mpi.cpp). Each body runs on
// one rank: it takes that rank's transport and records failed expectations in a thread-safe
// `Failures` (doctest assertions are not thread-safe; the caller reports them). Every rank must call
// the same bodies in the same order with the same arguments.
#pragma once

#include <seqpar/seqpar.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <numeric>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "support/strategy_list.hpp"

namespace seqpar::test {

/// Failed expectations collected from any number of rank threads.
class Failures {
 public:
  void expect(bool ok, const std::string& what) {
    if (ok) return;
    const std::lock_guard lock(mutex_);
    messages_.push_back(what);
  }
  [[nodiscard]] std::vector<std::string> messages() const {
    const std::lock_guard lock(mutex_);
    return messages_;
  }

 private:
  mutable std::mutex mutex_;
  std::vector<std::string> messages_;
};

namespace cases {

/// Payload byte i of what rank `src` sends to rank `dst` under `salt`: a misrouted, shifted or
/// truncated byte shows.
inline std::byte code(int src, int dst, std::size_t i, std::uint32_t salt = 0) {
  const auto h = static_cast<std::uint32_t>(src) * 2654435761u ^ static_cast<std::uint32_t>(dst) * 40503u ^
                 static_cast<std::uint32_t>(i) * 2246822519u ^ salt * 3266489917u;
  return static_cast<std::byte>((h >> 13) ^ (h >> 5) ^ static_cast<std::uint32_t>(i));
}
inline std::vector<std::byte> payload(int src, int dst, std::size_t bytes, std::uint32_t salt = 0) {
  std::vector<std::byte> b(bytes);
  for (std::size_t i = 0; i < bytes; ++i) b[i] = code(src, dst, i, salt);
  return b;
}
inline bool holds(std::span<const std::byte> got, int src, int dst, std::uint32_t salt = 0) {
  for (std::size_t i = 0; i < got.size(); ++i)
    if (got[i] != code(src, dst, i, salt)) return false;
  return true;
}
inline std::string at(int rank, const std::string& what) {
  return "rank " + std::to_string(rank) + ": " + what;
}

/// Bytes of the variable block rank `src` sends to rank `dst` (zero for about one pair in four,
/// always zero from a rank to rank (src + 1) % n, to cover empty blocks).
inline std::size_t v_bytes(int src, int dst, int n, std::uint32_t salt) {
  if (dst == (src + 1) % n) return 0;
  const std::uint32_t h =
      (static_cast<std::uint32_t>(src) * 7919u + static_cast<std::uint32_t>(dst) * 104729u + salt * 15485863u) % 1009u;
  return h % 4 == 0 ? 0 : 8 * (1 + h % 97);  // multiples of 8: the large-message path (unit = gcd) applies
}

/// What a transport's counters grew by since `before`; checked against the bytes the body sent.
template <Transport T>
void expect_traffic(Failures& f, const T& t, const TrafficCounters& before, const std::vector<std::uint64_t>& to_peer,
                    std::uint64_t messages, const std::string& what) {
  const TrafficCounters after = t.counters();
  std::vector<std::uint64_t> grew(to_peer.size());
  for (std::size_t i = 0; i < grew.size(); ++i) grew[i] = after.bytes_to_peer[i] - before.bytes_to_peer[i];
  f.expect(grew == to_peer, at(t.rank(), what + ": bytes_to_peer"));
  f.expect(after.bytes_sent - before.bytes_sent == std::accumulate(to_peer.begin(), to_peer.end(), std::uint64_t{0}),
           at(t.rank(), what + ": bytes_sent"));
  f.expect(after.messages_sent - before.messages_sent == messages,
           at(t.rank(), what + ": messages_sent grew by " + std::to_string(after.messages_sent - before.messages_sent) +
                            ", expected " + std::to_string(messages)));
}

}  // namespace cases

/// Point to point: every rank sends two messages per tag (two tags) to every rank including itself,
/// with isend, and receives them with irecv posted in the opposite tag order; then a blocking
/// send/recv ring. Checks payloads, per-(peer, tag) order, and counters.
template <Transport T>
void point_to_point_case(T& t, Failures& f) {
  using cases::payload;
  const int n = t.size(), me = t.rank();
  const TrafficCounters before = t.counters();
  std::vector<std::vector<std::byte>> out, in;
  std::vector<typename T::Request> requests;
  const auto bytes_of = [](int src, int dst, int tag, int k) {
    return static_cast<std::size_t>((src * 31 + dst * 7 + tag * 3 + k * 5) % 23) * 11;  // zero sometimes
  };
  const auto salt = [](int tag, int k) { return static_cast<std::uint32_t>(tag * 10 + k); };
  out.reserve(static_cast<std::size_t>(4 * n));
  in.reserve(static_cast<std::size_t>(4 * n));
  for (int dst = 0; dst < n; ++dst)
    for (int tag : {3, 9})
      for (int k = 0; k < 2; ++k) {
        out.push_back(payload(me, dst, bytes_of(me, dst, tag, k), salt(tag, k)));
        requests.push_back(t.isend(std::span<const std::byte>(out.back()), dst, tag));
      }
  for (int src = 0; src < n; ++src)
    for (int tag : {9, 3})
      for (int k = 0; k < 2; ++k) {
        in.emplace_back(bytes_of(src, me, tag, k));
        requests.push_back(t.irecv(std::span<std::byte>(in.back()), src, tag));
      }
  for (auto& r : requests) t.wait(r);
  std::size_t i = 0;
  for (int src = 0; src < n; ++src)
    for (int tag : {9, 3})
      for (int k = 0; k < 2; ++k, ++i)
        f.expect(cases::holds(in[i], src, me, salt(tag, k)),
                 cases::at(me, "isend/irecv from rank " + std::to_string(src) + " tag " + std::to_string(tag) +
                                   " message " + std::to_string(k)));
  std::vector<std::uint64_t> to_peer(static_cast<std::size_t>(n), 0);
  std::uint64_t messages = 0;
  for (int dst = 0; dst < n; ++dst)
    for (int tag : {3, 9})
      for (int k = 0; k < 2; ++k)
        if (dst != me) to_peer[static_cast<std::size_t>(dst)] += bytes_of(me, dst, tag, k), ++messages;

  // Blocking ring: post the receive first (an MPI send of a large message waits for it).
  const int next = (me + 1) % n, prev = (me + n - 1) % n;
  std::vector<std::byte> ring_in(1000 + static_cast<std::size_t>(prev));
  auto pending = t.irecv(std::span<std::byte>(ring_in), prev, 5);
  const std::vector<std::byte> ring_out = payload(me, next, 1000 + static_cast<std::size_t>(me), 77);
  t.send(std::span<const std::byte>(ring_out), next, 5);
  t.wait(pending);
  f.expect(!pending.pending(), cases::at(me, "a waited request is empty"));
  f.expect(cases::holds(ring_in, prev, me, 77), cases::at(me, "send/recv ring"));
  if (next != me) to_peer[static_cast<std::size_t>(next)] += ring_out.size(), ++messages;
  if (n > 1) {  // recv (blocking) of a message sent before it was posted
    std::vector<std::byte> got(64);
    const std::vector<std::byte> sent = payload(me, next, 64, 5);
    auto s = t.isend(std::span<const std::byte>(sent), next, 6);
    t.recv(std::span<std::byte>(got), prev, 6);
    t.wait(s);
    f.expect(cases::holds(got, prev, me, 5), cases::at(me, "recv"));
    to_peer[static_cast<std::size_t>(next)] += 64, ++messages;
  }
  cases::expect_traffic(f, t, before, to_peer, messages, "point to point");
  t.barrier();
}

/// A ring of isend/irecv steps: a block travels the whole ring (size() steps) and returns home
/// intact; each step posts the receive before the send, as the ring communicator does.
template <Transport T>
void ring_case(T& t, Failures& f, std::size_t bytes = 4096) {
  const int n = t.size(), me = t.rank();
  const int next = (me + 1) % n, prev = (me + n - 1) % n;
  std::vector<std::byte> cur = cases::payload(me, me, bytes, 11), nxt(bytes);
  const TrafficCounters before = t.counters();
  for (int step = 0; step < n; ++step) {
    auto r = t.irecv(std::span<std::byte>(nxt), prev, 100 + step);
    auto s = t.isend(std::span<const std::byte>(cur), next, 100 + step);
    t.wait(r);
    t.wait(s);
    std::swap(cur, nxt);
    const int origin = ((me - step - 1) % n + n) % n;
    f.expect(cases::holds(cur, origin, origin, 11),
             cases::at(me, "ring step " + std::to_string(step) + " holds rank " + std::to_string(origin) + "'s block"));
  }
  std::vector<std::uint64_t> to_peer(static_cast<std::size_t>(n), 0);
  if (n > 1) to_peer[static_cast<std::size_t>(next)] = bytes * static_cast<std::uint64_t>(n);
  cases::expect_traffic(f, t, before, to_peer, n > 1 ? static_cast<std::uint64_t>(n) : 0, "ring");
}

/// all_to_all with equal blocks of several sizes (including 0 and odd sizes), hash-coded.
template <Transport T>
void all_to_all_case(T& t, Failures& f, std::vector<std::size_t> blocks = {0, 1, 37, 4096}) {
  const int n = t.size(), me = t.rank();
  for (std::size_t block : blocks) {
    std::vector<std::byte> s, r(block * static_cast<std::size_t>(n));
    for (int dst = 0; dst < n; ++dst) {
      const auto b = cases::payload(me, dst, block, static_cast<std::uint32_t>(block));
      s.insert(s.end(), b.begin(), b.end());
    }
    const TrafficCounters before = t.counters();
    t.all_to_all(std::span<const std::byte>(s), std::span<std::byte>(r));
    for (int src = 0; src < n; ++src)
      f.expect(cases::holds(std::span<const std::byte>(r).subspan(static_cast<std::size_t>(src) * block, block), src,
                            me, static_cast<std::uint32_t>(block)),
               cases::at(me, "all_to_all block " + std::to_string(block) + " from rank " + std::to_string(src)));
    std::vector<std::uint64_t> to_peer(static_cast<std::size_t>(n), block);
    to_peer[static_cast<std::size_t>(me)] = 0;
    cases::expect_traffic(f, t, before, to_peer, block == 0 ? 0 : static_cast<std::uint64_t>(n - 1),
                          "all_to_all " + std::to_string(block));
  }
}

/// all_to_all_v with hash-chosen block sizes (some zero), twice with different sizes.
template <Transport T>
void all_to_all_v_case(T& t, Failures& f, std::uint32_t rounds = 2) {
  const int n = t.size(), me = t.rank();
  for (std::uint32_t salt = 1; salt <= rounds; ++salt) {
    std::vector<std::size_t> sc(static_cast<std::size_t>(n)), rc(static_cast<std::size_t>(n));
    std::vector<std::byte> s;
    for (int dst = 0; dst < n; ++dst) {
      sc[static_cast<std::size_t>(dst)] = cases::v_bytes(me, dst, n, salt);
      rc[static_cast<std::size_t>(dst)] = cases::v_bytes(dst, me, n, salt);
      const auto b = cases::payload(me, dst, sc[static_cast<std::size_t>(dst)], salt);
      s.insert(s.end(), b.begin(), b.end());
    }
    std::vector<std::byte> r(std::accumulate(rc.begin(), rc.end(), std::size_t{0}));
    const TrafficCounters before = t.counters();
    t.all_to_all_v(std::span<const std::byte>(s), std::span<const std::size_t>(sc), std::span<std::byte>(r),
                   std::span<const std::size_t>(rc));
    std::size_t offset = 0;
    for (int src = 0; src < n; ++src) {
      const std::size_t len = rc[static_cast<std::size_t>(src)];
      f.expect(cases::holds(std::span<const std::byte>(r).subspan(offset, len), src, me, salt),
               cases::at(me, "all_to_all_v from rank " + std::to_string(src)));
      offset += len;
    }
    std::vector<std::uint64_t> to_peer(sc.begin(), sc.end());
    to_peer[static_cast<std::size_t>(me)] = 0;
    const auto messages = static_cast<std::uint64_t>(
        std::count_if(to_peer.begin(), to_peer.end(), [](std::uint64_t b) { return b != 0; }));
    cases::expect_traffic(f, t, before, to_peer, messages, "all_to_all_v");
  }
}

/// all_gather (equal contributions, including empty) and all_gather_v (one rank contributes nothing).
template <Transport T>
void all_gather_case(T& t, Failures& f) {
  const int n = t.size(), me = t.rank();
  const auto un = static_cast<std::size_t>(n);
  for (std::size_t bytes : {std::size_t{0}, std::size_t{13}, std::size_t{1024}}) {
    const auto s = cases::payload(me, -1, bytes, 21);
    std::vector<std::byte> r(bytes * un);
    const TrafficCounters before = t.counters();
    t.all_gather(std::span<const std::byte>(s), std::span<std::byte>(r));
    for (int src = 0; src < n; ++src)
      f.expect(cases::holds(std::span<const std::byte>(r).subspan(static_cast<std::size_t>(src) * bytes, bytes), src,
                            -1, 21),
               cases::at(me, "all_gather " + std::to_string(bytes) + " from rank " + std::to_string(src)));
    std::vector<std::uint64_t> to_peer(un, bytes);
    to_peer[static_cast<std::size_t>(me)] = 0;
    cases::expect_traffic(f, t, before, to_peer, bytes == 0 ? 0 : un - 1, "all_gather");
  }
  std::vector<std::size_t> counts(un);
  for (int i = 0; i < n; ++i)
    counts[static_cast<std::size_t>(i)] = i == n - 1 ? 0 : 8 * static_cast<std::size_t>(3 + 5 * i);
  const auto s = cases::payload(me, -2, counts[static_cast<std::size_t>(me)], 22);
  std::vector<std::byte> r(std::accumulate(counts.begin(), counts.end(), std::size_t{0}));
  const TrafficCounters before = t.counters();
  t.all_gather_v(std::span<const std::byte>(s), std::span<std::byte>(r), std::span<const std::size_t>(counts));
  std::size_t offset = 0;
  for (int src = 0; src < n; ++src) {
    const std::size_t len = counts[static_cast<std::size_t>(src)];
    f.expect(cases::holds(std::span<const std::byte>(r).subspan(offset, len), src, -2, 22),
             cases::at(me, "all_gather_v from rank " + std::to_string(src)));
    offset += len;
  }
  std::vector<std::uint64_t> to_peer(un, s.size());
  to_peer[static_cast<std::size_t>(me)] = 0;
  cases::expect_traffic(f, t, before, to_peer, s.empty() ? 0 : un - 1, "all_gather_v");
}

/// split: even/odd groups ordered by descending rank, then an identity split; membership and order
/// checked with an all_gather inside each group; a split's traffic is counted on the split object.
template <Transport T>
void split_case(T& t, Failures& f) {
  const int n = t.size(), me = t.rank();
  T half = t.split(me % 2, -me);
  const int members = (n - me % 2 + 1) / 2;
  f.expect(half.size() == members, cases::at(me, "split size " + std::to_string(half.size())));
  std::vector<int> expected;
  for (int r = n - 1; r >= 0; --r)
    if (r % 2 == me % 2) expected.push_back(r);
  const auto pos = std::find(expected.begin(), expected.end(), me) - expected.begin();
  f.expect(half.rank() == static_cast<int>(pos), cases::at(me, "split rank " + std::to_string(half.rank())));
  std::vector<int> got(static_cast<std::size_t>(half.size()));
  const TrafficCounters parent_before = t.counters();
  half.all_gather(as_bytes_of(std::span<const int>(&me, 1)), as_writable_bytes_of(std::span<int>(got)));
  f.expect(got == expected, cases::at(me, "split members in key order"));
  f.expect(t.counters().bytes_sent == parent_before.bytes_sent, cases::at(me, "split traffic counted on the parent"));
  f.expect(half.counters().bytes_sent == sizeof(int) * static_cast<std::size_t>(half.size() - 1),
           cases::at(me, "split traffic counted on the split"));
  ring_case(half, f, 96);
  T same = half.split(0, 0);
  f.expect(same.size() == half.size() && same.rank() == half.rank(), cases::at(me, "identity split"));
  same.barrier();
  T moved = std::move(same);  // a moved transport keeps working
  moved.barrier();
  t.barrier();
}

/// Bad arguments throw std::invalid_argument on the calling rank, before any communication.
template <Transport T>
void bad_arguments_case(T& t, Failures& f) {
  const int n = t.size(), me = t.rank();
  std::vector<std::byte> buf(8 * static_cast<std::size_t>(n)), out(buf.size() + 1);
  const std::span<const std::byte> s(buf);
  const auto throws = [&](auto&& call, const std::string& what, const std::string& names) {
    try {
      call();
      f.expect(false, cases::at(me, what + " did not throw"));
    } catch (const std::invalid_argument& e) {
      f.expect(std::string(e.what()).find(names) != std::string::npos,
               cases::at(me, what + ": message '" + e.what() + "' does not name " + names));
    } catch (const std::exception& e) {
      f.expect(false, cases::at(me, what + " threw '" + e.what() + "', not std::invalid_argument"));
    }
  };
  throws([&] { t.send(s, n, 0); }, "send to peer size()", "peer = " + std::to_string(n));
  throws([&] { t.send(s, -1, 0); }, "send to peer -1", "peer = -1");
  throws([&] { (void)t.irecv(std::span<std::byte>(buf), 0, -3); }, "irecv with tag -3", "tag = -3");
  throws([&] { t.all_to_all(s, std::span<std::byte>(out)); }, "all_to_all with r.size() != s.size()", "r.size()");
  throws([&] { t.all_to_all(s.first(s.size() - 1), std::span<std::byte>(out).first(s.size() - 1)); },
         "all_to_all with a size not a multiple of size()", "s.size()");
  std::vector<std::size_t> short_counts(static_cast<std::size_t>(n) + 1, 0);
  throws([&] { t.all_to_all_v(s, short_counts, std::span<std::byte>(out), short_counts); },
         "all_to_all_v with size()+1 counts", "send_counts.size()");
  throws(
      [&] {
        t.all_to_all_v(s, std::span<const std::size_t>(short_counts).first(static_cast<std::size_t>(n)),
                       std::span<std::byte>(out),
                       std::span<const std::size_t>(short_counts).first(static_cast<std::size_t>(n)));
      },
      "all_to_all_v with counts that do not sum to the buffer", "sum(send_counts)");
  throws([&] { t.all_gather(s, std::span<std::byte>(out)); }, "all_gather with a wrong r.size()", "r.size()");
  throws([&] { (void)t.split(-1, 0); }, "split with color -1", "color = -1");
  t.barrier();  // nothing above communicated: every rank still meets here
}

/// A receive into a buffer of the wrong size throws Errc::kProtocol (larger and smaller message).
template <Transport T>
void protocol_case(T& t, Failures& f) {
  const int n = t.size(), me = t.rank();
  if (n < 2) return;
  const int next = (me + 1) % n, prev = (me + n - 1) % n;
  for (const auto& [sent, room] : {std::pair<std::size_t, std::size_t>{16, 8}, {8, 16}}) {
    const std::vector<std::byte> out(sent, std::byte{1});
    std::vector<std::byte> in(room);
    auto s = t.isend(std::span<const std::byte>(out), next, 40);
    try {
      t.recv(std::span<std::byte>(in), prev, 40);
      f.expect(false, cases::at(me, std::to_string(sent) + "-byte message into " + std::to_string(room) +
                                        " bytes did not throw"));
    } catch (const Error& e) {
      f.expect(e.code() == std::error_code(static_cast<int>(Errc::kProtocol), error_category()),
               cases::at(me, std::string("wrong-size receive is not Errc::kProtocol: ") + e.what()));
    } catch (const std::exception& e) {
      f.expect(false, cases::at(me, std::string("wrong-size receive threw a non-seqpar::Error: ") + e.what()));
    }
    t.wait(s);
    t.barrier();
  }
}

/// Every transport case above, in order.
template <Transport T>
void all_transport_cases(T& t, Failures& f) {
  point_to_point_case(t, f);
  ring_case(t, f);
  all_to_all_case(t, f);
  all_to_all_v_case(t, f);
  all_gather_case(t, f);
  split_case(t, f);
  bad_arguments_case(t, f);
  protocol_case(t, f);
}

// ---- strategies over any transport ------------------------------------------------------------------

/// A small batch every rank builds identically: `sequences` sequences of lognormal documents.
inline DocumentBatch small_batch(int sequences, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<std::int64_t>> seqs;
  for (int b = 0; b < sequences; ++b) {
    std::lognormal_distribution<double> len(std::log(9.0), 1.0);
    std::vector<std::int64_t> docs;
    for (std::int64_t left = 48 + 11 * b; left > 0; left -= docs.back())
      docs.push_back(std::clamp<std::int64_t>(static_cast<std::int64_t>(len(rng)), 1, left));
    seqs.push_back(std::move(docs));
  }
  return DocumentBatch(seqs);
}

/// Runs DistributedAttention<S, Reference<double>> over transport `t` on `batch`: every rank computes
/// the fp64 reference over the whole batch (same seed, same inputs), runs forward and backward on
/// its shard, and compares its shard of O, LSE, dQ, dK, dV (tolerance 1e-10: only the summation
/// order differs) and its counted bytes with the program's declared bytes. Returns false (checking
/// nothing) when the strategy refuses the batch on this topology.
template <class S, Transport T>
bool strategy_case(T& t, Failures& f, const std::string& name, const DocumentBatch& batch, const AttentionShape& shape,
                   typename S::Arguments args = {}, std::uint32_t seed = 7) {
  using Kernel = attention::Reference<double>;
  constexpr double kTolerance = 1e-10;
  const int me = t.rank();
  const Topology topo{t.size(), args.ranks_per_node == 0 ? t.size() : args.ranks_per_node};
  if (!S::can_implement(args, batch, shape, topo)) return false;
  const std::int64_t n = batch.total_tokens();
  const int d = shape.head_dim;
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  ThdTensor<double> q(n, shape.heads_q, d), k(n, shape.heads_kv, d), v(n, shape.heads_kv, d), dout(n, shape.heads_q, d),
      o(n, shape.heads_q, d), dq(n, shape.heads_q, d), dk(n, shape.heads_kv, d), dv(n, shape.heads_kv, d);
  LseTensor<double> lse(shape.heads_q, n);
  for (auto* x : {&q, &k, &v, &dout})
    for (double& e : x->storage) e = normal(rng);
  const Kernel ref;
  const auto slices = batch.document_causal_slices();
  ref.forward(shape, q.view(), k.view(), v.view(), slices, o.view(), lse.view());
  ref.backward(shape, q.view(), k.view(), v.view(), o.view(), lse.view(), dout.view(), slices, dq.view(), dk.view(),
               dv.view());

  DistributedAttention<S, Kernel> attn(t, shape, args);
  const auto& owned = attn.owned_ranges(batch);
  const std::int64_t local = attn.local_tokens(batch);
  const auto shard = [&](const ThdTensor<double>& g) {  // (local, heads, d): the owned rows in plan order
    ThdTensor<double> l(local, g.heads, d);
    std::int64_t row = 0;
    for (const Range& r : owned)
      for (std::int64_t tok = r.begin; tok < r.end; ++tok, ++row)
        for (int h = 0; h < g.heads; ++h)
          for (int x = 0; x < d; ++x) l.view()(row, h, x) = g.view()(tok, h, x);
    return l;
  };
  const auto lq = shard(q), lk = shard(k), lv = shard(v), ldo = shard(dout);
  ThdTensor<double> lo(local, shape.heads_q, d), ldq(local, shape.heads_q, d), ldk(local, shape.heads_kv, d),
      ldv(local, shape.heads_kv, d);
  LseTensor<double> llse(shape.heads_q, local);
  attn.forward(batch, lq.view(), lk.view(), lv.view(), lo.view(), llse.view());
  const auto& prog = attn.program(batch);
  f.expect(attn.last_bytes_sent() == prog.forward.bytes_sent(sizeof(double), sizeof(double)),
           cases::at(me, name + ": forward bytes counted " + std::to_string(attn.last_bytes_sent()) + " != declared " +
                             std::to_string(prog.forward.bytes_sent(sizeof(double), sizeof(double)))));
  attn.backward(batch, lq.view(), lk.view(), lv.view(), lo.view(), llse.view(), ldo.view(), ldq.view(), ldk.view(),
                ldv.view());
  f.expect(attn.last_bytes_sent() == prog.backward.bytes_sent(sizeof(double), sizeof(double)),
           cases::at(me, name + ": backward bytes counted != declared"));

  const auto rel = [&](const ThdTensor<double>& want, const ThdTensor<double>& got) {
    const ThdTensor<double> w = shard(want);
    double scale = 0, err = 0;
    for (std::size_t i = 0; i < w.storage.size(); ++i) {
      scale = std::max(scale, std::abs(w.storage[i]));
      err = std::max(err, std::abs(w.storage[i] - got.storage[i]));
    }
    return scale > 0 ? err / scale : err;
  };
  double lse_err = 0;
  std::int64_t row = 0;
  for (const Range& r : owned)
    for (std::int64_t tok = r.begin; tok < r.end; ++tok, ++row)
      for (int h = 0; h < shape.heads_q; ++h)
        lse_err = std::max(
            lse_err, std::abs(lse.view()(h, tok) - llse.view()(h, row)) / std::max(1.0, std::abs(lse.view()(h, tok))));
  const double errs[5] = {rel(o, lo), lse_err, rel(dq, ldq), rel(dk, ldk), rel(dv, ldv)};
  const char* names[5] = {"O", "LSE", "dQ", "dK", "dV"};
  for (int i = 0; i < 5; ++i)
    f.expect(errs[i] < kTolerance, cases::at(me, name + ": " + names[i] + " error " + std::to_string(errs[i])));
  return true;
}

/// The batch a transport strategy runs on: small_batch(1, 2026) or small_batch(3, 99).
enum class CaseBatch { kOneSequence, kThreeSequences };

/// One strategy every transport runs: a combination of tests/support/strategy_list.hpp, its batch,
/// and its ranks per node (0: one node).
template <class P, class V, CaseBatch kBatch = CaseBatch::kThreeSequences, int kRanksPerNode = 0>
struct TransportStrategy : Combination<P, V> {
  static_assert(kListed<P, Partitioners> && kListed<V, Communicators>,
                "transport strategies are combinations of tests/support/strategy_list.hpp");
  static constexpr CaseBatch batch = kBatch;
  static constexpr int ranks_per_node = kRanksPerNode;
};

/// The strategies every transport must run exactly, on 2, 4 and 8 ranks.
using TransportStrategies = std::tuple<
    TransportStrategy<partition::Uniform, communicators::AllToAll>,                      // Ulysses
    TransportStrategy<partition::Zigzag, communicators::Ring, CaseBatch::kOneSequence>,  // zigzag ring
    TransportStrategy<partition::Zigzag, communicators::RingShardingAware>,              // HSAP-style ring
    TransportStrategy<partition::Uniform, communicators::Hierarchical, CaseBatch::kThreeSequences, 2>,  // USP
    TransportStrategy<partition::BatchAware<partition::PerDoc>, communicators::Ring>,                   // BASP
    TransportStrategy<partition::Zigzag, communicators::AllGather>,                                     // Llama 3 CP
    TransportStrategy<partition::Hybrid, communicators::AllGatherShardingAware>>;                       // FlashCP
inline constexpr int kNumTransportStrategies = static_cast<int>(std::tuple_size_v<TransportStrategies>);
// Under a sanitizer the strategy suite runs only strategy_list.hpp's sanitizer sweep; these are run there
// too (backend, mpi), and are kept off that diagonal so that the two reach different pairs.
static_assert(
    []<class... Ts>(std::tuple<Ts...>*) {
      return (!in_sanitizer_sweep(kIndexOf<typename Ts::partitioner, Partitioners>,
                                  kIndexOf<typename Ts::variant, Communicators>) &&
              ...);
    }(static_cast<TransportStrategies*>(nullptr)),
    "a transport strategy is on strategy_list.hpp's sanitizer sweep");

/// Runs every strategy of TransportStrategies over `t`; returns how many the topology accepted (all of
/// them, on 2, 4 and 8 ranks: kNumTransportStrategies).
template <Transport T>
int all_strategy_cases(T& t, Failures& f) {
  const AttentionShape shape{8, 4, 8};  // GQA 8:4, head_dim 8: every head count divides 2, 4, 8 ranks
  const DocumentBatch one = small_batch(1, 2026), three = small_batch(3, 99);
  int accepted = 0;
  for_each_type<TransportStrategies>([&]<class C>(std::type_identity<C>) {
    typename C::strategy::Arguments args = C::arguments();
    args.ranks_per_node = C::ranks_per_node;
    accepted += strategy_case<typename C::strategy>(t, f, C::name(), C::batch == CaseBatch::kOneSequence ? one : three,
                                                    shape, args);
  });
  return accepted;
}

}  // namespace seqpar::test
