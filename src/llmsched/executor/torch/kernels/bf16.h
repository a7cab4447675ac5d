/* bfloat16 <-> float32 conversions shared by the kernels. A bfloat16 value
 * is the top half of a float32, so widening is exact; narrowing rounds, and
 * the two roundings here are the two that PyTorch's paths use. */
#ifndef LLMSCHED_BF16_H
#define LLMSCHED_BF16_H

#include <stdint.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

INLINE float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round half away from zero, NaN kept quiet: embedding_bag's bfloat16 output. */
INLINE uint16_t f32_to_bf16_away(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x8000u) >> 16);
}

/* Round to nearest even, NaN to 0xffff: PyTorch's float -> bfloat16 conversion. */
INLINE uint16_t f32_to_bf16_even(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? 0xffffu : rounded);
}

#endif
