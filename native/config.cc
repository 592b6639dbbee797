#include "config.h"

#include <cstdlib>

#include "common.h"

namespace smddp {

const std::vector<ConfigVar>& config_table() {
  static const std::vector<ConfigVar> table = {
      {"SMDDP_TIMEOUT", "60",
       "seconds a collective may wait for its peers (or a peer stay silent) before every rank "
       "fails with an error naming the missing or dead ranks"},
      {"SMDDP_FUSION_THRESHOLD", "26214400",
       "bytes: allreduces of one dtype and op that are ready together are fused into buckets "
       "up to this size (the original's 25 MB bucket)"},
      {"SMDDP_CACHE_CAPACITY", "1024",
       "entries in the response cache; a cached tensor is negotiated by a 4-byte id instead "
       "of its full description"},
      {"SMDDP_HIT_EXCHANGE", "1",
       "1: ranks agree on cached collectives peer to peer, each sending every other rank the "
       "cache ids it has ready (a bit-vector AND in the manner of Horovod's, one hop, no round "
       "trip through rank 0; n-1 small messages per rank and cycle); 0: through rank 0. Must be "
       "the same on every rank"},
      {"SMDDP_SHM_SLOT_BYTES", "4194304",
       "bytes of each rank's shared-memory staging slot used by the intra-host allreduce and "
       "broadcast (two slots per rank are allocated)"},
      {"SMDDP_SHM_RING_BYTES", "1048576",
       "bytes of each direction of an intra-host point-to-point shared-memory channel"},
      {"SMDDP_RING_THRESHOLD", "524288",
       "bytes: with ranks on several hosts, allreduces at or above this size use a flat ring "
       "over all ranks, smaller ones the hierarchical algorithm (shared memory inside a host, "
       "TCP ring between host leaders). The default is measured with bench/allreduce_algorithms.py "
       "on simulated hosts over loopback; rerun it on a real network to tune"},
      {"SMDDP_CMA", "auto",
       "intra-host allreduce reads peers' buffers directly with cross-memory attach "
       "(process_vm_readv): auto (when the kernel allows it), 1 (required), 0 (off: stage "
       "through shared memory). With auto or 1 each rank allows any process of the same user "
       "to read its memory (prctl PR_SET_PTRACER_ANY, needed under Yama ptrace_scope=1); 0 "
       "leaves the process's ptrace setting untouched"},
      {"SMDDP_CMA_THRESHOLD", "262144",
       "bytes: intra-host allreduces at or above this size use cross-memory attach when enabled"},
      {"SMDDP_ALGORITHM", "auto", "allreduce algorithm across hosts: auto, ring or hierarchical"},
      {"SMDDP_SPIN_US", "auto",
       "microseconds a waiting rank keeps yielding the CPU before it sleeps on its futex "
       "doorbell; auto: 200 when every local rank has a spare core, else 50 (longer spinning would "
       "steal the core from the training computation)"},
      {"SMDDP_TIMELINE", "",
       "path prefix: each rank writes PREFIX.rank<N>.json, a Chrome trace of negotiation, "
       "queueing, copies and transfers per tensor (open in Perfetto or chrome://tracing); smp "
       "pipelines also write PREFIX.smp.rank<N>.json (compute per microbatch, sends)"},
      {"SMDDP_LOG_LEVEL", "1", "0 errors, 1 warnings, 2 info, 3 debug"},
      {"SMDDP_STALL_WARNING", "30",
       "seconds after which a tensor some ranks submitted and others did not is logged with "
       "the missing ranks; and after which a pipeline rank whose smp step waits with nothing "
       "arriving or computing logs what it waits for"},
      {"SMDDP_NCCL_LIBRARY", "",
       "path of libnccl.so.2 for CUDA tensors; default: the copy already loaded by the framework, "
       "then the nvidia-nccl wheel's, then the system's"},
      {"SMDDP_CUDART_LIBRARY", "",
       "path of the CUDA runtime (libcudart.so); default: the copy already loaded by the framework"},
      {"SMDDP_NCCL_MAX_CTAS", "",
       "most thread blocks (SMs) one NCCL collective of smddp may occupy; empty: NCCL's choice. "
       "Fewer leave more SMs to the backward pass that communication overlaps"},
      {"SMDDP_CUDA_CHECKS", "1",
       "1: every collective on CUDA tensors is also negotiated (its signature only) through the CPU "
       "engine, so ranks that disagree on shape, dtype, op or root, or a dead rank, abort NCCL with "
       "a message naming the difference instead of hanging; 0: off (saves a few microseconds a call)"},
      {"SMDDP_CUDA_CHECK_BACKLOG", "1024",
       "argument checks of CUDA collectives a rank may queue while its peers catch up (a check "
       "name is reused every 16 calls of a kind, after its earlier holder is agreed); the "
       "collectives themselves are not held back. At the limit the calling thread waits. "
       "0: never queue (wait whenever a name is still in use)"},
      {"SMDDP_CHECK_CALLING_THREAD", "1",
       "1: collectives matched by call order (every torch.distributed call on smddp, and the "
       "argument checks of CUDA collectives) carry the number of the thread that called, threads "
       "numbered per process group by their first call; ranks whose k-th call came from different "
       "threads fail with an error saying so, instead of reducing one thread's tensor with another's. "
       "0: off, for programs that hand a group's calls from thread to thread in an order they fix "
       "(e.g. a pool of several threads running one task at a time). Must be the same on every rank"},
      {"SMDDP_SMP_OUTPUT_BACKWARD", "1",
       "smp pipelines: 1: when the root module is an nn.Sequential whose last children live on "
       "another partition, that partition keeps its result as its copy of the model output and "
       "starts each microbatch's backward from its own copy of the loss (as a last pipeline stage "
       "does), saving two messages per microbatch; needs the step function to compute the same "
       "loss from the same output on every rank. 0: the root sends the output's gradient"},
      {"SMDDP_SMP_HOLD_ANSWER_MS", "50",
       "smp pipelines, \"interleaved\", with SMDDP_SMP_OUTPUT_BACKWARD: the last stage holds the "
       "root's copy of each microbatch's output until its backward and sends it in the input "
       "gradients' message, one message a microbatch instead of two. Sent alone at once when the "
       "step function calls the model again or ends without model.backward, and after this many "
       "ms otherwise (a step function that waits on the root between its model call and "
       "model.backward, in a collective say, then pays this per microbatch). 0: sent at once"},
      {"SMDDP_SMP_INLINE_OUTPUT", "1",
       "smp pipelines, \"interleaved\", with held answers (SMDDP_SMP_HOLD_ANSWER_MS > 0): 1: the "
       "last stage's step function serves the root's call that makes its own copy of the model "
       "output and goes straight on to the loss, instead of a serve runner computing the output "
       "and waking it (a thread hand-off a microbatch between the stage's forward and backward). "
       "Calls still start in arrival order. 0: a serve runner serves it"},
      {"SMDDP_SMP_CHAIN_CALLS", "1",
       "smp pipelines: 1: consecutive runs of an nn.Sequential's children on other partitions are "
       "one chained call: each stage sends its output straight to the next and, in the backward, "
       "its input gradients straight to the previous one, so activations cross each stage boundary "
       "once. 0: every run is a call that returns to the rank running the Sequential (the root)"},
      {"SMDDP_SMP_P2P_MAX_CTAS", "2",
       "smp pipelines on CUDA: the most thread blocks (SMs) one NCCL transfer between two pipeline "
       "stages may occupy. A stage posts its receives as soon as the peer announces a message, so "
       "they wait on the GPU beside the stage's compute, and each SM they hold is one its matrix "
       "multiplies cannot use (NCCL's own choice made graphed steps 1.3x slower on 2 x H200). "
       "0: NCCL's choice"},
      {"SMDDP_SMP_CUDA_GRAPHS", "0",
       "smp pipelines on CUDA: 1: a run of consecutive nn.Sequential children that a stage owns "
       "entirely is captured as CUDA graphs (forward and backward) after two eager runs of its "
       "shape, and replayed for later microbatches of that shape, one graph pair per microbatch "
       "in flight (the host issues two launches instead of hundreds). Results equal the eager "
       "run's as long as the children's Python code takes the same path every call. 0: eager"},
      {"SMDDP_SMP_DEFER_WEIGHT_GRADS", "0",
       "smp pipelines with SMDDP_SMP_CUDA_GRAPHS=1: 1: a graphed run whose input needs a gradient "
       "(every stage but the first) captures its backward as two graphs, the input's gradient "
       "first and the weights' gradients after, and the input gradients' message leaves between "
       "them, so the previous stage's backward starts a weight pass earlier (a 2-stage step: "
       "3m + 2 instead of 3m + 3 units). Costs the gradients kept between the passes (about one "
       "activation per matrix product) in the backward pool. Runs where a weight is used twice "
       "along the input's path keep one pass. 0: one backward graph"},
      {"SMDDP_SMP_FREE_BLAS_WORKSPACES", "1",
       "smp pipelines on CUDA, eager steps: 1: a thread that gives the compute token back frees "
       "torch's cuBLAS and cuBLASLt workspaces (32 MiB each on Hopper, kept per thread), so a stage "
       "holds only its computing thread's and its peak matches torch's 1F1B. torch frees every "
       "thread's at once: set 0 if threads outside smp run matrix products on the default stream "
       "during smp.step"},
      {"SMDDP_CONSISTENCY_CHECK", "1",
       "1: once per training loop (the second gradient reduction of each TensorFlow tape or "
       "optimizer, and after the second batch of model.fit with the broadcast callback) the ranks "
       "compare checksums of their trainable variables and raise, naming the first that differs, "
       "if they do not hold the same model; 0: off"},
      {"SMDDP_TORCH_BACKEND", "auto",
       "how init_process_group(\"smddp\") runs: native (the C++ c10d Backend, built against the "
       "installed torch on first import; an error if it cannot be built), python (the Python process "
       "group, no per-device Backend), auto (native, else python with a warning naming why)"},
      {"SMDDP_TORCH_EXTENSION_DIR", "",
       "where the C++ c10d Backend is built and cached; default ~/.cache/smdistributed/torch-backend, "
       "one build per torch version, install location and source"},
      {"SMDDP_TF_KERAS_COMPAT", "1",
       "1: on Keras 3 the TensorFlow frontend lets scripts written for Keras 2 call "
       "optimizer.variables() (a list that may also be called; frontends/tensorflow/compat.py); "
       "0: Keras is left alone"},
      {"SMDDP_RANK", "", "set by smddprun for each process: its rank in the job (read at discovery)"},
      {"SMDDP_SIZE", "", "set by smddprun: the number of processes in the job"},
      {"SMDDP_LOCAL_RANK", "", "set by smddprun: the process's rank among those on its host"},
      {"SMDDP_LOCAL_SIZE", "", "set by smddprun: the number of processes on the process's host"},
      {"SMDDP_NCCL_MIN_CTAS", "", "fewest thread blocks one NCCL collective of smddp uses; empty: NCCL's choice"},
      {"SMDDP_HOST", "",
       "overrides the host name used to group ranks into hosts (tests simulate several hosts "
       "on one machine with it)"},
      {"SMDDP_SECRET", "",
       "shared secret every connection presents; smddprun generates one per job. Without it "
       "a secret derived from the job's identifiers is used and a warning printed"},
      {"SMDDP_STORE_ADDR", "",
       "address of the rendezvous store (served by rank 0); defaults to MASTER_ADDR, then "
       "127.0.0.1"},
      {"SMDDP_STORE_PORT", "",
       "port of the rendezvous store; defaults to MASTER_PORT+1 (MASTER_PORT is torch's), "
       "then a port derived from the job id"},
  };
  return table;
}

static const ConfigVar& find_var(const std::string& name) {
  for (const auto& v : config_table()) {
    if (name == v.name) return v;
  }
  throw Error("unknown configuration variable " + name);
}

std::string config_string(const std::string& name) {
  const ConfigVar& var = find_var(name);
  const char* env = std::getenv(name.c_str());
  return env && *env ? std::string(env) : std::string(var.default_value);
}

int64_t config_int(const std::string& name) {
  std::string s = config_string(name);
  try {
    size_t used = 0;
    int64_t v = std::stoll(s, &used);
    if (used != s.size()) throw std::invalid_argument(s);
    return v;
  } catch (const std::exception&) {
    throw Error(name + "='" + s + "' is not an integer");
  }
}

double config_double(const std::string& name) {
  std::string s = config_string(name);
  try {
    size_t used = 0;
    double v = std::stod(s, &used);
    if (used != s.size()) throw std::invalid_argument(s);
    return v;
  } catch (const std::exception&) {
    throw Error(name + "='" + s + "' is not a number");
  }
}

EngineConfig EngineConfig::from_environment() {
  EngineConfig c;
  c.timeout_s = config_double("SMDDP_TIMEOUT");
  c.fusion_bytes = config_int("SMDDP_FUSION_THRESHOLD");
  c.cache_capacity = config_int("SMDDP_CACHE_CAPACITY");
  c.hit_exchange = config_int("SMDDP_HIT_EXCHANGE") != 0;
  c.check_calling_thread = config_int("SMDDP_CHECK_CALLING_THREAD") != 0;
  c.cuda_check_backlog = config_int("SMDDP_CUDA_CHECK_BACKLOG");
  if (c.cuda_check_backlog < 0) throw Error("SMDDP_CUDA_CHECK_BACKLOG must be 0 or more");
  c.shm_slot_bytes = config_int("SMDDP_SHM_SLOT_BYTES");
  c.shm_ring_bytes = config_int("SMDDP_SHM_RING_BYTES");
  c.ring_threshold = config_int("SMDDP_RING_THRESHOLD");
  c.algorithm = config_string("SMDDP_ALGORITHM");
  c.spin_us = config_string("SMDDP_SPIN_US") == "auto" ? -1 : config_int("SMDDP_SPIN_US");
  c.cma = config_string("SMDDP_CMA");
  c.cma_threshold = config_int("SMDDP_CMA_THRESHOLD");
  if (c.cma != "auto" && c.cma != "0" && c.cma != "1")
    throw Error("SMDDP_CMA must be auto, 0 or 1, not '" + c.cma + "'");
  c.timeline_path = config_string("SMDDP_TIMELINE");
  c.log_level = int(config_int("SMDDP_LOG_LEVEL"));
  c.stall_warning_s = config_double("SMDDP_STALL_WARNING");
  if (c.timeout_s <= 0) throw Error("SMDDP_TIMEOUT must be positive");
  if (c.shm_slot_bytes < 4096 || c.shm_slot_bytes % 64)
    throw Error("SMDDP_SHM_SLOT_BYTES must be a multiple of 64 and at least 4096");
  if (c.shm_ring_bytes < 4096) throw Error("SMDDP_SHM_RING_BYTES must be at least 4096");
  if (c.algorithm != "auto" && c.algorithm != "ring" && c.algorithm != "hierarchical")
    throw Error("SMDDP_ALGORITHM must be auto, ring or hierarchical, not '" + c.algorithm + "'");
  return c;
}

}  // namespace smddp
