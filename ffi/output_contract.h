// The write contract of every output the attention kernels write: how the dispatches of one
// call write it (emu::WriteRule). The emulated device's sanitizer checks a call against it
// (initcheck's end-of-call contract; docs/testing.md has the table). Every output tile is written
// by exactly one threadgroup of one dispatch (no atomics, no accumulation across the plan's
// chunks: each chunk is a disjoint box of its stage's grid), so every output is written once.
#ifndef JAX_FLASH_METAL_OUTPUT_CONTRACT_H_
#define JAX_FLASH_METAL_OUTPUT_CONTRACT_H_

#include "../emulator/sanitizer.h"
#include "attention_params.h"

namespace jfm {

struct OutputContract {
  int buffer;  // JFM_BUFFER_*
  const char* name;
  emu::WriteRule rule;
};

inline constexpr OutputContract kOutputContracts[] = {
    {JFM_BUFFER_O, "O", emu::WriteRule::kOnce},
    {JFM_BUFFER_LSE, "LSE", emu::WriteRule::kOnce},
    {JFM_BUFFER_ROW_MAX, "row max", emu::WriteRule::kOnce},
    {JFM_BUFFER_LOG_SUM, "log-sum", emu::WriteRule::kOnce},
    {JFM_BUFFER_WORKSPACE, "decode workspace", emu::WriteRule::kOnce},
    {JFM_BUFFER_DELTA, "D", emu::WriteRule::kOnce},
    {JFM_BUFFER_DQ, "dQ", emu::WriteRule::kOnce},
    {JFM_BUFFER_DK, "dK", emu::WriteRule::kOnce},
    {JFM_BUFFER_DV, "dV", emu::WriteRule::kOnce},
    {JFM_BUFFER_DBIAS, "dbias", emu::WriteRule::kOnce},
    {JFM_BUFFER_DALIBI, "dalibi", emu::WriteRule::kOnce},
};

// The contract of the output bound at [[buffer(index)]], nullptr for an index no kernel writes.
inline const OutputContract* output_contract(int index) {
  for (const OutputContract& c : kOutputContracts)
    if (c.buffer == index) return &c;
  return nullptr;
}

}  // namespace jfm

#endif  // JAX_FLASH_METAL_OUTPUT_CONTRACT_H_
