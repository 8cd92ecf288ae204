// SPDX-License-Identifier: Apache-2.0
// The CPU side of the NCCL transport, run on every machine (label nccl_host; no GPU needed): the file
// store of the bootstrap, argument checks made before any CUDA or NCCL call, the order a flush issues
// posted operations in, and the nccl-tests bandwidth convention of bench/transport_nccl.
#include <doctest/doctest.h>

#include <seqpar/backend/nccl.hpp>

#include <chrono>
#include <cstddef>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "support/bus_bandwidth.hpp"
#include "support/expect_error.hpp"

using seqpar::Errc;
using seqpar::backend::nccl::FileStore;
using seqpar::backend::nccl::Transport;
using seqpar::backend::nccl::UniqueId;
using namespace std::chrono_literals;

namespace {

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// A fresh path in the temporary folder, removed on destruction.
struct TempPath {
  std::filesystem::path path;
  explicit TempPath(const std::string& name)
      : path(std::filesystem::temp_directory_path() /
             ("seqpar_nccl_host_" + name + "_" +
              std::to_string(std::chrono::steady_clock::now().time_since_epoch().count()))) {}
  ~TempPath() {
    std::error_code ec;
    std::filesystem::remove(path, ec);
  }
};

std::vector<std::byte> bytes_of(const std::string& s) {
  std::vector<std::byte> b;
  for (char c : s) b.push_back(static_cast<std::byte>(c));
  return b;
}

}  // namespace

TEST_SUITE("nccl_host") {
  TEST_CASE("nccl FileStore: publish then fetch, replace, remove") {
    TempPath tmp("store");
    const FileStore store(tmp.path, 2s);
    const auto value = bytes_of("a unique id of the job");
    store.publish(value);
    std::vector<std::byte> got(value.size());
    store.fetch(got);
    CHECK(got == value);
    const auto again = bytes_of("another id, same length!");  // a file left there is replaced
    REQUIRE(again.size() != value.size());
    store.publish(again);
    std::vector<std::byte> got2(again.size());
    store.fetch(got2);
    CHECK(got2 == again);
    // No temporary file is left beside it.
    int files = 0;
    for (const auto& e : std::filesystem::directory_iterator(tmp.path.parent_path()))
      if (e.path().filename().string().rfind(tmp.path.filename().string(), 0) == 0) ++files;
    CHECK(files == 1);
    store.remove();
    CHECK_FALSE(std::filesystem::exists(tmp.path));
    store.remove();  // removing a file that is gone is no error
  }

  TEST_CASE("nccl FileStore: a value that never appears times out naming the path") {
    TempPath tmp("missing");
    const FileStore store(tmp.path, 150ms);
    std::vector<std::byte> got(128);
    const auto start = std::chrono::steady_clock::now();
    try {
      store.fetch(got);
      FAIL("fetch of a missing file returned");
    } catch (const seqpar::Error& e) {
      const auto took = std::chrono::steady_clock::now() - start;
      CHECK(e.errc() == Errc::kTimeout);
      CHECK(took >= 150ms);
      CHECK(took < 5s);
      INFO(e.what());
      CHECK(contains(e.what(), tmp.path.string()));
      CHECK(contains(e.what(), "150 ms"));
      CHECK(contains(e.what(), "rank 0"));
    }
  }

  TEST_CASE("nccl FileStore: a file of another size is another job's (Errc::kProtocol)") {
    TempPath tmp("size");
    { std::ofstream(tmp.path, std::ios::binary) << "short"; }
    std::vector<std::byte> got(128);
    try {
      FileStore(tmp.path, 1s).fetch(got);
      FAIL("fetch of a 5-byte file into 128 bytes returned");
    } catch (const seqpar::Error& e) {
      CHECK(e.errc() == Errc::kProtocol);
      CHECK(contains(e.what(), "5 bytes, expected 128"));
    }
  }

  TEST_CASE("nccl FileStore: bad arguments and an unwritable path") {
    CHECK(contains(seqpar::test::invalid_message([] { (void)FileStore(""); }), "path"));
    CHECK(contains(seqpar::test::invalid_message([] { (void)FileStore("/tmp/x", 0ms); }), "timeout = 0 ms"));
    const FileStore nowhere("/nonexistent_folder_of_seqpar/id", 1s);
    try {
      nowhere.publish(bytes_of("id"));
      FAIL("publish into a missing folder returned");
    } catch (const seqpar::Error& e) {
      CHECK(e.errc() == Errc::kTransport);
      CHECK(contains(e.what(), "/nonexistent_folder_of_seqpar/id"));
    }
  }

  TEST_CASE("nccl Transport: arguments are checked before any CUDA or NCCL call") {
    const UniqueId id{};
    CHECK(contains(seqpar::test::invalid_message([&] { (void)Transport(id, 2, 2); }), "rank = 2"));
    CHECK(contains(seqpar::test::invalid_message([&] { (void)Transport(id, -1, 2); }), "rank = -1"));
    CHECK(contains(seqpar::test::invalid_message([&] { (void)Transport(id, 0, 0); }), "size = 0"));
    CHECK(contains(seqpar::test::invalid_message([&] { (void)Transport(id, 0, 1, {.timeout = 0ms}); }),
                   "options.timeout = 0 ms"));
    CHECK(contains(seqpar::test::invalid_message([&] { (void)Transport(id, 0, 1, {.device = -2}); }),
                   "options.device = -2"));
  }

  TEST_CASE("nccl Transport::bootstrap: a rank whose rank 0 never publishes times out in the store") {
    TempPath tmp("bootstrap");
    FileStore store(tmp.path, 100ms);
    try {
      (void)Transport::bootstrap(store, 1, 2, {.timeout = 100ms});
      FAIL("bootstrap without rank 0 returned");
    } catch (const seqpar::Error& e) {
      CHECK(e.errc() == Errc::kTimeout);
      CHECK(contains(e.what(), tmp.path.string()));
    }
    CHECK(contains(seqpar::test::invalid_message([&] { (void)Transport::bootstrap(store, 3, 2); }), "rank = 3"));
  }

  TEST_CASE("nccl flush order: sender and receiver issue the same messages in the same order") {
    using seqpar::backend::nccl::detail::PostedOp;
    // Rank 0 posts to rank 1: tag 9 twice, tag 3 twice, tag 5 once; rank 1 posts its receives from
    // rank 0 in another order of tags. Sorted by (tag, post order) both sides list tag 3 (first, second),
    // tag 5, tag 9 (first, second): NCCL, which matches in issue order, pairs them by tag.
    const auto batch = [](bool send, std::vector<int> tags) {
      std::vector<PostedOp> ops;
      for (std::size_t i = 0; i < tags.size(); ++i)
        ops.push_back({.send = send, .peer = send ? 1 : 0, .tag = tags[i], .post = static_cast<std::uint32_t>(i)});
      return ops;
    };
    auto sends = batch(true, {9, 9, 3, 3, 5});
    auto recvs = batch(false, {3, 5, 9, 3, 9});
    seqpar::backend::nccl::detail::order_for_issue(sends);
    seqpar::backend::nccl::detail::order_for_issue(recvs);
    std::vector<int> send_tags, recv_tags;
    for (const auto& op : sends) send_tags.push_back(op.tag);
    for (const auto& op : recvs) recv_tags.push_back(op.tag);
    CHECK(send_tags == std::vector<int>{3, 3, 5, 9, 9});
    CHECK(recv_tags == send_tags);
    // Within a tag, post order is kept (the k-th send of a tag meets the k-th receive of it).
    CHECK(sends[0].post == 2);
    CHECK(sends[1].post == 3);
    CHECK(recvs[0].post == 0);
    CHECK(recvs[1].post == 3);
  }

  TEST_CASE("bench bandwidth: nccl-tests' algbw and busbw") {
    using seqpar::bench::Collective;
    // 64 MiB in 1 ms on 8 ranks.
    const std::size_t bytes = std::size_t{64} << 20;
    const auto a2a = seqpar::bench::bandwidth(Collective::kAllToAll, bytes, 8, 1e-3);
    CHECK(a2a.algbw == doctest::Approx(67.108864));
    CHECK(a2a.busbw == doctest::Approx(67.108864 * 7 / 8));
    const auto ag = seqpar::bench::bandwidth(Collective::kAllGather, bytes, 8, 1e-3);
    CHECK(ag.busbw == doctest::Approx(a2a.busbw));
    const auto p2p = seqpar::bench::bandwidth(Collective::kSendRecv, bytes, 8, 1e-3);
    CHECK(p2p.busbw == doctest::Approx(p2p.algbw));
    // One rank: nothing crosses a link.
    CHECK(seqpar::bench::bandwidth(Collective::kAllToAll, bytes, 1, 1e-3).busbw == 0.0);
    CHECK(seqpar::bench::bus_factor(Collective::kAllGather, 2) == 0.5);
    CHECK_THROWS_AS((void)seqpar::bench::bandwidth(Collective::kSendRecv, bytes, 2, 0.0), std::invalid_argument);
    CHECK_THROWS_AS((void)seqpar::bench::bus_factor(Collective::kSendRecv, 0), std::invalid_argument);
  }
}
