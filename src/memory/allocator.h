// Where an arena's bytes come from: one allocator per kind of memory, chosen per tier.
//
// On a CPU build Device and Host are both RAM: `heap_allocator()` (aligned heap below 256 KiB, whole mapped
// pages above, unmapped on free so the process RSS follows the ledger). A CUDA build adds device memory and
// pinned host memory behind the same interface.
//
// The strict device mode (OOMLESS_STRICT_DEVICE=1, or `set_strict_device(true)` before the first arena)
// gives Device memory from `guarded_allocator()`: one reserved address range that stays PROT_NONE except while
// a `DeviceAccess` is open. Every backend call opens one (backend/strict_ops.h), as does the Offloader's
// worker while it copies, so code above backend/ that reads or writes Device memory itself faults at once,
// and the fault names itself (the address, that it is Device memory touched outside the backend, and a
// backtrace) before the process dies. The fast suite passes in this mode (`make test-strict`): it is how the
// device boundary is kept.
#pragma once
#include <cstddef>

#include "core/tier.h"

namespace oomless {

class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual const char* name() const = 0;
  // 64-byte aligned memory of at least `bytes`, or nullptr when the system refuses.
  virtual void* allocate(size_t bytes) = 0;
  // The same, every byte zero (a device allocator clears it on the device).
  virtual void* allocate_zeroed(size_t bytes) = 0;
  virtual void deallocate(void* p, size_t bytes) = 0;
  // Clears bytes [p, p + bytes) of memory it handed out (where the memory is: on the device for a device
  // allocator), for memory/'s own users (a page pool's pages, a sub-arena's carvings).
  virtual void zero(void* p, size_t bytes) = 0;
};

Allocator& heap_allocator();
Allocator& guarded_allocator();
// The allocator an arena of tier t takes by default: Device memory is guarded in the strict device mode.
Allocator& tier_allocator(Tier t);

// Whether the strict device mode is on: set_strict_device's value, else OOMLESS_STRICT_DEVICE=1.
bool strict_device();
void set_strict_device(bool on);

// Opens guarded Device memory to host code while it lives. Scopes nest and every thread shares one count:
// the memory is open while any scope is.
class DeviceAccess {
 public:
  DeviceAccess();
  ~DeviceAccess();
  DeviceAccess(const DeviceAccess&) = delete;
  DeviceAccess& operator=(const DeviceAccess&) = delete;
};

// Whether p lies in the guarded range (reserved or not): for tests and the fault's message.
bool in_guarded_range(const void* p);

}  // namespace oomless
