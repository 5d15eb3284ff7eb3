// CRC32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum every
// spilled page carries (worker/tier_store.h). Crc32c("123456789") is
// 0xE3069283. On x86-64 CPUs with SSE4.2 the crc32 instruction is used
// (about 10x the table speed); elsewhere slicing-by-8 tables. Both give the
// same value for the same bytes.
//
// Thread contract: pure functions, thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>

namespace triax::worker {

// Extends `crc` (the value of the bytes before; 0 to start) over `data`.
uint32_t Crc32c(const void* data, size_t bytes, uint32_t crc = 0);

// The portable table implementation, exposed so tests can check that the
// hardware path agrees with it.
uint32_t Crc32cPortable(const void* data, size_t bytes, uint32_t crc = 0);

}  // namespace triax::worker
