// Rendezvous key-value store: rank 0 serves it over TCP, every rank (rank 0 included) is a
// client. Ranks publish their addresses through it and wait for each other's. Every
// connection must first present the job's shared secret; a wrong or missing one is refused
// and logged.
#pragma once

#include <atomic>
#include <map>
#include <mutex>
#include <string>
#include <thread>

#include "socket.h"

namespace smddp {

// Limits of the store's server: nothing a client that has not proved the secret sends can
// cost more than a handshake frame or keep it for longer than the handshake deadline.
struct StoreLimits {
  size_t handshake_bytes = 4096;      // the secret's frame
  size_t request_bytes = 1 << 20;     // one set/get after authentication
  double handshake_deadline_s = 2.0;  // to connect and present the secret
  size_t max_connections = 256;       // open at once; more are closed at accept
};

class StoreServer {
 public:
  // `generation`: which start of the engine in this process (see StoreClient). `loopback`:
  // bind 127.0.0.1 only (every rank is on this host), else every interface.
  StoreServer(int port, std::string secret, int generation, bool loopback, StoreLimits limits = {});
  ~StoreServer();
  int port() const { return port_; }
  // Connections turned away: a wrong secret, an oversized or garbage frame, a handshake that
  // did not finish within its deadline, or one over the connection cap. Each is logged.
  int refused_connections() const { return refused_.load(); }
  void stop();

 private:
  void serve();
  Socket listener_;
  int port_;
  std::string secret_;
  int generation_;
  StoreLimits limits_;
  std::atomic<bool> stopping_{false};
  std::atomic<int> refused_{0};
  std::map<std::string, std::string> data_;
  std::thread thread_;
};

// Where ranks publish and look up bootstrap records: our own store, or a framework's
// (torch.distributed's c10d store, through the Python binding).
class Rendezvous {
 public:
  virtual ~Rendezvous() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  // Blocks until the key exists; throws PeerError naming the key after timeout_s.
  virtual std::string get(const std::string& key, double timeout_s) = 0;
};

class StoreClient : public Rendezvous {
 public:
  // Connects (retrying until timeout_s) to the store of the same `generation`: a rank that
  // re-initialises may first reach rank 0's store of the previous start, still being shut down.
  StoreClient(const std::string& host, int port, const std::string& secret, double timeout_s, int generation);
  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key, double timeout_s) override;
  std::string local_ip() const { return sock_.local_ip(); }

 private:
  std::string request(const std::string& payload);
  Socket sock_;
  double timeout_s_;
  std::mutex mutex_;
};

}  // namespace smddp
