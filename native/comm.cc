#include "comm.h"

#include <poll.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <sstream>

#include "cma.h"
#include "frame_reader.h"
#include "messages.h"
#include "wait.h"
#include "wire.h"

namespace smddp {

namespace {

std::vector<std::string> split_lines(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string line;
  while (std::getline(ss, line)) out.push_back(line);
  return out;
}

std::string hex_hash(const std::string& s) {
  // FNV-1a: only to make a short, job-unique shared-memory name, not for security.
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

}  // namespace

Comm::Comm(const WorldSpec& spec, const EngineConfig& config)
    : config_(config), rank_(spec.rank), size_(spec.size), secret_(spec.secret) {
  if (size_ < 1) throw Error("world size must be at least 1, got " + std::to_string(size_));
  if (rank_ < 0 || rank_ >= size_)
    throw Error("rank " + std::to_string(rank_) + " is outside the world of size " + std::to_string(size_));
  channels_.resize(size_);
  for (auto& c : channels_) c.resize(kNumChannelKinds);
  if (size_ == 1) {
    host_ranks_ = {{0}};
    rank_host_ = {0};
  } else {
    try {
      bootstrap(spec);
    } catch (...) {
      if (segment_) segment_->unlink();
      throw;
    }
  }
  if (config_.spin_us < 0) {
    cpu_set_t set;
    int cores = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
    config_.spin_us = cores >= 2 * local_size_ ? 200 : 50;
  }
}

Comm::~Comm() {
  for (auto& per_peer : channels_)
    for (auto& ch : per_peer)
      if (ch) ch->close();
  if (store_server_) store_server_->stop();
}

namespace {
// A store reached through loopback means every rank is on this host: listen on loopback only.
bool is_loopback(const std::string& addr) { return addr.rfind("127.", 0) == 0 || addr == "localhost" || addr == "::1"; }
constexpr double kHandshakeDeadline = 2.0;  // seconds an accepted connection has to identify itself
constexpr size_t kHandshakeBytes = 4096;
}  // namespace

void Comm::bootstrap(const WorldSpec& spec) {
  const double timeout = config_.timeout_s;
  const bool loopback = !spec.rendezvous && is_loopback(spec.store_addr);
  std::string my_addr = spec.advertise_addr;
  if (spec.rendezvous) {
    store_ = spec.rendezvous;
    if (my_addr.empty()) my_addr = "127.0.0.1";
  } else {
    if (spec.store_port <= 0)
      throw Error("a world of " + std::to_string(size_) +
                  " ranks needs a rendezvous store port "
                  "(SMDDP_STORE_PORT or MASTER_PORT)");
    // Engines a process starts one after another (init, shutdown, init) bootstrap through
    // stores of the same address; the generation tells a rank that reaches rank 0's previous
    // store, still serving while rank 0 shuts down, to wait for the new one.
    static std::atomic<int> generations{0};
    const int generation = generations++;
    if (rank_ == 0) store_server_ = std::make_unique<StoreServer>(spec.store_port, secret_, generation, loopback);
    auto client = std::make_shared<StoreClient>(spec.store_addr, spec.store_port, secret_, timeout, generation);
    if (my_addr.empty()) my_addr = client->local_ip();
    store_ = client;
  }

  // 1. Publish how to reach this rank; learn everyone else's.
  Socket listener = Socket::listen_on(0, loopback);
  std::ostringstream me;
  me << spec.host << "\n"
     << my_addr << "\n"
     << listener.local_port() << "\n"
     << ::getpid() << "\n"
     << kProtocolVersion << "\n";
  store_->set("rank/" + std::to_string(rank_), me.str());
  std::vector<std::string> hosts(size_), addrs(size_);
  std::vector<int> ports(size_);
  for (int r = 0; r < size_; ++r) {
    std::vector<std::string> f;
    try {
      f = split_lines(store_->get("rank/" + std::to_string(r), timeout));
    } catch (const PeerError& e) {
      // Engines start with a group's first collective (torch groups are made lazily), so a
      // rank that never calls it is missing here rather than from the collective.
      throw PeerError("rank " + std::to_string(r) + " did not join within " + std::to_string(int(timeout)) +
                      " s: every rank of the group must call its first collective (" + e.what() + ")");
    }
    // Ranks built from different versions of the library would misread each other's messages.
    const std::string theirs = f.size() >= 5 ? f[4] : "1 (or older)";
    if (theirs != std::to_string(kProtocolVersion))
      throw Error("rank " + std::to_string(r) + " runs smdistributed's wire protocol " + theirs + ", this rank (" +
                  std::to_string(rank_) + ") protocol " + std::to_string(kProtocolVersion) +
                  ": install the same version of the library on every host");
    try {
      hosts[r] = f.at(0);
      addrs[r] = f.at(1);
      ports[r] = std::stoi(f.at(2));
    } catch (const std::exception&) {
      throw Error("malformed rendezvous record of rank " + std::to_string(r));
    }
  }

  // 2. Group ranks into hosts by host key, hosts ordered by their lowest rank.
  std::map<std::string, int> host_id;
  rank_host_.resize(size_);
  for (int r = 0; r < size_; ++r) {
    auto it = host_id.find(hosts[r]);
    if (it == host_id.end()) {
      it = host_id.emplace(hosts[r], int(host_ranks_.size())).first;
      host_ranks_.emplace_back();
    }
    rank_host_[r] = it->second;
    host_ranks_[it->second].push_back(r);
  }
  host_index_ = rank_host_[rank_];
  const auto& mine = host_ranks_[host_index_];
  local_size_ = int(mine.size());
  local_rank_ = int(std::find(mine.begin(), mine.end(), rank_) - mine.begin());
  if ((spec.local_rank >= 0 && spec.local_rank != local_rank_) ||
      (spec.local_size >= 0 && spec.local_size != local_size_)) {
    throw Error("inconsistent launch environment: the launcher says local rank " + std::to_string(spec.local_rank) +
                " of " + std::to_string(spec.local_size) + ", but ranks sharing host '" + spec.host +
                "' make this local rank " + std::to_string(local_rank_) + " of " + std::to_string(local_size_) +
                " (check LOCAL_RANK/LOCAL_WORLD_SIZE or SMDDP_HOST)");
  }

  // 3. The host's shared memory segment: the leader creates it, everyone maps it, the
  //    leader unlinks it once all have, so a crash leaves nothing in /dev/shm.
  std::string hkey = "host/" + std::to_string(host_index_);
  if (local_size_ > 1) {
    if (local_rank_ == 0) {
      std::string name = "/smddp-" + hex_hash(secret_ + spec.store_addr + std::to_string(spec.store_port) + spec.host) +
                         "-" + std::to_string(::getpid());
      segment_ = std::make_unique<HostSegment>(name, 0, local_size_, rank_, config_.shm_slot_bytes,
                                               config_.shm_ring_bytes, true);
      store_->set(hkey + "/shm", name);
      for (int lr = 1; lr < local_size_; ++lr) store_->get(hkey + "/attached/" + std::to_string(lr), timeout);
      segment_->unlink();
    } else {
      std::string name = store_->get(hkey + "/shm", timeout);
      segment_ = std::make_unique<HostSegment>(name, local_rank_, local_size_, rank_, config_.shm_slot_bytes,
                                               config_.shm_ring_bytes, false);
      store_->set(hkey + "/attached/" + std::to_string(local_rank_), "1");
    }
    for (int lr = 0; lr < local_size_; ++lr) {
      if (lr == local_rank_) continue;
      int peer = mine[lr];
      for (int k = 0; k < kNumChannelKinds; ++k)
        channels_[peer][k] = std::make_unique<ShmChannel>(peer, segment_->ring(local_rank_, lr, k),
                                                          segment_->ring(lr, local_rank_, k), &segment_->doorbell(lr));
    }
  }

  // 4. TCP mesh between ranks on different hosts.
  if (host_ranks_.size() > 1) {
    // Lower rank connects; each connection first presents the secret, its rank and kind.
    for (int peer = rank_ + 1; peer < size_; ++peer) {
      if (rank_host_[peer] == host_index_) continue;
      for (int k = 0; k < kNumChannelKinds; ++k) {
        Socket s = Socket::connect_to(addrs[peer], ports[peer], timeout);
        Writer w;
        w.put_string(secret_);
        w.put<int32_t>(rank_);
        w.put<int32_t>(k);
        send_frame(s, w.str(), timeout, "TCP handshake with rank " + std::to_string(peer));
        s.set_nonblocking(true);
        channels_[peer][k] = std::make_unique<TcpChannel>(peer, std::move(s));
      }
    }
    int expected = 0;
    for (int peer = 0; peer < rank_; ++peer)
      if (rank_host_[peer] != host_index_) expected += kNumChannelKinds;
    accept_peer_connections(listener, expected, timeout);
  }

  // 5. Everyone is wired: a store barrier so no rank starts before its peers are ready.
  store_->set("ready/" + std::to_string(rank_), "1");
  for (int r = 0; r < size_; ++r) store_->get("ready/" + std::to_string(r), timeout);
  if (spec.rendezvous) store_.reset();  // a framework's store is needed for bootstrap only

  // 6. Can local ranks read each other's memory? (All local ranks probe together.)
  if (segment_ && config_.cma != "0") {
    cma_enabled_ = probe_cma(*this);
    if (!cma_enabled_ && config_.cma == "1")
      throw Error(
          "SMDDP_CMA=1 but process_vm_readv between local ranks is not permitted here "
          "(Yama ptrace_scope or a seccomp profile forbids it); use SMDDP_CMA=auto or 0");
    SMDDP_LOG(2, std::string("cross-memory attach ") + (cma_enabled_ ? "enabled" : "unavailable"));
  }
}

Channel* Comm::channel(int peer, ChannelKind kind) {
  Channel* ch = channels_.at(peer).at(kind).get();
  if (!ch) throw Error("no channel from rank " + std::to_string(rank_) + " to rank " + std::to_string(peer));
  return ch;
}

void Comm::check_alive(const std::string& what) {
  if (segment_) segment_->check_alive(what.c_str());
}

void Comm::run(std::vector<Transfer>& transfers, const std::string& what) {
  // Sleep on our doorbell only if every byte comes through shared memory; sockets are polled.
  bool all_shm = segment_ != nullptr;
  for (auto& t : transfers) all_shm = all_shm && t.channel->is_shared_memory();
  Doorbell* bell = all_shm ? &segment_->doorbell(local_rank_) : nullptr;
  Backoff backoff(config_.spin_us, bell);
  auto last_progress = Clock::now();
  size_t remaining = 0;
  for (auto& t : transfers) remaining += t.done < t.n ? 1 : 0;
  while (remaining > 0) {
    const uint32_t seen = bell ? bell->rings.load(std::memory_order_acquire) : 0;
    bool progressed = false;
    for (auto& t : transfers) {
      if (t.done >= t.n) continue;
      size_t moved = t.is_send ? t.channel->try_send(t.ptr + t.done, t.n - t.done)
                               : t.channel->try_recv(t.ptr + t.done, t.n - t.done);
      if (moved) {
        progressed = true;
        t.done += moved;
        if (t.done == t.n) --remaining;
      }
    }
    if (progressed) {
      last_progress = Clock::now();
      continue;
    }
    if (backoff.pause(seen)) {
      check_alive(what);
      if (seconds_since(last_progress) > config_.timeout_s) {
        std::string waiting;
        for (auto& t : transfers)
          if (t.done < t.n) waiting += (waiting.empty() ? "" : ", ") + std::to_string(t.channel->peer());
        throw PeerError(what + ": no data from/to rank(s) " + waiting + " for " +
                        std::to_string(int(config_.timeout_s)) + " s (SMDDP_TIMEOUT); the peer is stuck or dead");
      }
    }
  }
}

void Comm::send_message(int peer, ChannelKind kind, const std::string& payload, const std::string& what) {
  uint64_t len = payload.size();
  std::vector<Transfer> t = {{channel(peer, kind), true, reinterpret_cast<char*>(&len), sizeof(len)},
                             {channel(peer, kind), true, const_cast<char*>(payload.data()), payload.size()}};
  // The header must precede the body: run them in order.
  std::vector<Transfer> head = {t[0]}, body = {t[1]};
  run(head, what);
  run(body, what);
}

void Comm::host_barrier(const std::string& what) {
  if (!segment_) return;
  auto start = Clock::now();
  segment_->barrier(config_.spin_us, [&] {
    check_alive(what);
    if (seconds_since(start) > config_.timeout_s)
      throw PeerError(what + ": a rank on this host did not arrive within " + std::to_string(int(config_.timeout_s)) +
                      " s (SMDDP_TIMEOUT)");
  });
}

void Comm::abort(const std::string& message) {
  if (aborted_) return;
  aborted_ = true;
  if (segment_) segment_->raise_abort(message);
  for (auto& per_peer : channels_)
    for (auto& ch : per_peer)
      if (ch) ch->close();
}

// Accepts `expected` handshakes from lower ranks on other hosts. Every pending connection is
// read a little at a time on one poll(), with a size cap and a short deadline, so an idle or
// hostile connection is dropped (and logged) without holding up the real ones.
void Comm::accept_peer_connections(Socket& listener, int expected, double timeout) {
  struct Pending {
    Socket sock;
    std::string desc;
    FrameReader reader{kHandshakeBytes};
    Clock::time_point deadline;
  };
  std::vector<std::unique_ptr<Pending>> pending;
  listener.set_nonblocking(true);
  auto start = Clock::now();
  while (expected > 0) {
    if (seconds_since(start) > timeout)
      throw PeerError("timed out waiting for TCP connections from ranks on other hosts");
    std::vector<pollfd> fds{{listener.fd(), POLLIN, 0}};
    for (auto& p : pending) fds.push_back({p->sock.fd(), POLLIN, 0});
    ::poll(fds.data(), fds.size(), 50);
    if (fds[0].revents & POLLIN) {
      while (pending.size() < 256) {
        auto p = std::make_unique<Pending>();
        p->sock = listener.accept_within(0, &p->desc);
        if (!p->sock.valid()) break;
        p->sock.set_nonblocking(true);
        p->deadline = Clock::now() + std::chrono::milliseconds(int64_t(kHandshakeDeadline * 1000));
        pending.push_back(std::move(p));
      }
    }
    const auto now = Clock::now();
    for (auto& p : pending) {
      try {
        if (!p->reader.read_some(p->sock, "TCP handshake from " + p->desc)) {
          if (now > p->deadline) {
            SMDDP_LOG(0, "dropped a connection from " + p->desc + ": no handshake within " +
                             std::to_string(kHandshakeDeadline) + " s");
            p->sock.close();
            ++bootstrap_refused_;
          }
          continue;
        }
        Reader r(p->reader.take());
        std::string secret = r.get_string();
        int peer = r.get<int32_t>();
        int k = r.get<int32_t>();
        if (!secrets_equal(secret, secret_)) {
          SMDDP_LOG(0,
                    "refused a connection from " + p->desc + ": it presented a wrong or missing secret (SMDDP_SECRET)");
          p->sock.close();
          ++bootstrap_refused_;
          continue;
        }
        if (peer < 0 || peer >= rank_ || rank_host_[peer] == host_index_ || k < 0 || k >= kNumChannelKinds ||
            channels_[peer][k])
          throw Error("unexpected handshake (rank " + std::to_string(peer) + ", channel " + std::to_string(k) + ")");
        channels_[peer][k] = std::make_unique<TcpChannel>(peer, std::move(p->sock));
        --expected;
      } catch (const Error& e) {
        SMDDP_LOG(0, "dropped a bad connection from " + p->desc + ": " + e.what());
        p->sock.close();
        ++bootstrap_refused_;
      }
    }
    pending.erase(std::remove_if(pending.begin(), pending.end(), [](const auto& p) { return !p->sock.valid(); }),
                  pending.end());
  }
}

}  // namespace smddp
