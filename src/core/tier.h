// Where bytes live. On a CPU-only run Device and Host are both RAM (Device is the working set).
#pragma once
#include <cstdint>

namespace oomless {

enum class Tier : uint8_t { Device, Host, Disk };
inline constexpr int kTierCount = 3;

inline const char* tier_name(Tier t) {
  switch (t) {
    case Tier::Device: return "device";
    case Tier::Host: return "host";
    case Tier::Disk: return "disk";
  }
  return "?";
}

}  // namespace oomless
