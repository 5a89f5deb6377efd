// Counter-based random numbers (Philox4x32-10, Salmon et al. 2011), identical on host and
// device. A dropout mask is a pure function of (seed, stage, step, micro-batch, site,
// element), so recompute reproduces it bit for bit without saving RNG state.
//
// Note [Dropout keys]
// The 64-bit Philox key is the seed. The 128-bit counter is (element / 4 + group_offset,
// stream), where `stream` packs (stage, step, micro-batch, site) into 96 bits: stage 16 bits,
// site 16 bits, micro-batch 16 bits, step 48 bits. One Philox call yields four uniforms, for
// elements 4k..4k+3. Nothing depends on thread count, device or call order.
// group_offset (default 0) places a tensor inside a larger one: a kernel that handles
// elements [o, o + n) of a larger tensor, o a multiple of 4, sets group_offset = o / 4, so its
// local element i draws the uniform of global element o + i, and its n masks are exactly those
// the whole tensor's dropout gives these elements. Sequence parallelism relies on it: each
// rank drops out its shard of the rows and gets the mask the unsharded tensor would. Every
// dropout kernel draws through philox_uniform4 or its vectorised copy (philox_batch in
// kernels/cpu/elementwise.cc), both of which add the offset.
#pragma once

#include <cstdint>

#include "tensor/dtype.h"

namespace porter::tensor {

struct PhiloxKey {
  uint64_t seed = 0;
  uint32_t stream[3] = {0, 0, 0};  // packed (stage, step, micro-batch, site)
  uint64_t group_offset = 0;       // added to every group counter (Note [Dropout keys])
};

PORTER_HD inline PhiloxKey dropout_key(uint64_t seed, uint32_t stage, uint64_t step,
                                       uint32_t micro_batch, uint32_t site) {
  PhiloxKey k;
  k.seed = seed;
  k.stream[0] = (stage & 0xffffu) | ((site & 0xffffu) << 16);
  k.stream[1] = (micro_batch & 0xffffu) | (static_cast<uint32_t>(step & 0xffffu) << 16);
  k.stream[2] = static_cast<uint32_t>((step >> 16) & 0xffffffffu);
  return k;
}

struct Philox4 {
  uint32_t v[4];
};

PORTER_HD inline uint32_t mulhilo32(uint32_t a, uint32_t b, uint32_t* hi) {
  uint64_t p = static_cast<uint64_t>(a) * b;
  *hi = static_cast<uint32_t>(p >> 32);
  return static_cast<uint32_t>(p);
}

// Philox4x32 with 10 rounds on counter `ctr` and key `key`.
PORTER_HD inline Philox4 philox4x32_10(Philox4 ctr, uint32_t key0, uint32_t key1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, hi1;
    uint32_t lo0 = mulhilo32(kM0, ctr.v[0], &hi0);
    uint32_t lo1 = mulhilo32(kM1, ctr.v[2], &hi1);
    ctr = Philox4{{hi1 ^ ctr.v[1] ^ key0, lo1, hi0 ^ ctr.v[3] ^ key1, lo0}};
    key0 += kW0;
    key1 += kW1;
  }
  return ctr;
}

// Four uniforms in [0, 1) for elements 4*group .. 4*group+3 of the stream `key`, shifted by
// its group_offset (Note [Dropout keys]).
PORTER_HD inline void philox_uniform4(const PhiloxKey& key, uint64_t local_group, float out[4]) {
  const uint64_t group = local_group + key.group_offset;
  Philox4 ctr{{static_cast<uint32_t>(group), key.stream[0] ^ static_cast<uint32_t>(group >> 32),
               key.stream[1], key.stream[2]}};
  Philox4 r = philox4x32_10(ctr, static_cast<uint32_t>(key.seed),
                            static_cast<uint32_t>(key.seed >> 32));
  for (int i = 0; i < 4; ++i) out[i] = static_cast<float>(r.v[i] >> 8) * (1.0f / 16777216.0f);
}

// The uniform of local element `element`: global element element + 4 * key.group_offset.
PORTER_HD inline float philox_uniform(const PhiloxKey& key, uint64_t element) {
  float u[4];
  philox_uniform4(key, element / 4, u);
  return u[element % 4];
}

}  // namespace porter::tensor
