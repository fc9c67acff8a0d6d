// Kernel profile of the emulated device: while profiling is on, every Dispatch it runs uses the
// counting variant of its kernel and appends one record (python -m jax_flash_metal.profile).
#ifndef JAX_FLASH_METAL_EMULATOR_PROFILE_H_
#define JAX_FLASH_METAL_EMULATOR_PROFILE_H_

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "../emulator/emulator.h"

namespace jfm {

struct ProfileRecord {
  std::string kernel;
  std::array<uint32_t, 3> groups;      // threadgroups per grid of the Dispatch
  std::array<uint32_t, 3> group_size;  // threads per threadgroup
  uint32_t function_constants;         // the Dispatch's (its pipeline's) function constants
  emu::Profile counts;
};

// Turns recording on (clearing earlier records) or off. Returns "" or an error message (this
// build has no counting variant).
std::string set_emulator_profiling(bool on);
// The records since profiling was turned on, in launch order; clears them.
std::vector<ProfileRecord> take_emulator_profile();

}  // namespace jfm

#endif  // JAX_FLASH_METAL_EMULATOR_PROFILE_H_
