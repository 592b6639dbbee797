// Checks of a collective's arguments, before any buffer is touched.
//
// Two places check. submit() checks what one rank can know alone (sizes against shapes,
// splits against counts, output capacities against what the call will write) and throws at
// once: nothing is queued, the engine is unaffected. The coordinator checks what only all
// ranks' announcements together tell (the rows each rank will receive from a ragged
// allgather or alltoall against each receiver's output capacity and expected rows) and
// answers every rank with the same error, so a bad call fails on every rank and the engine
// keeps working.
//
// The announced ragged information (Entry::per_rank) is laid out as:
//   allgather: [rows sent, expected rows from each rank (P, optional), output capacity]
//   alltoall:  [rows sent to each rank (P), expected rows from each rank (P, optional),
//               output capacity]
// where the capacity is in bytes, or -1 when the engine allocates the output.
#pragma once

#include <string>
#include <vector>

#include "messages.h"

namespace smddp {

// Throws Error naming the collective and what is wrong. `per_rank` is the caller's (without
// the capacity, which submit() appends).
void validate_submission(const std::string& name, const Signature& sig, const void* in, const void* out, size_t count,
                         size_t out_capacity, const std::vector<int64_t>& per_rank, int rank, int size);

// The coordinator's check of one ragged collective, given every rank's announced per_rank;
// "" when every rank's output fits and every expectation holds.
std::string check_ragged(const std::string& name, const Signature& sig,
                         const std::vector<std::vector<int64_t>>& per_rank, int size);

// The output capacity (bytes, -1: engine-owned) at the end of an announced per_rank record.
inline int64_t announced_capacity(const std::vector<int64_t>& record) { return record.empty() ? -1 : record.back(); }

}  // namespace smddp
