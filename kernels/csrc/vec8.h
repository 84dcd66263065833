/* Eight fp32 lanes and what the CPU kernels do with them (paged_decode_cpu.c's softmax,
 * decode_ops_cpu.c's SwiGLU): GCC and Clang lower these vectors to whatever the target has
 * (one AVX2 register; AVX-512 machines run them as well, and Zen 4 at the same rate). Loads
 * and stores may be unaligned and alias the pool's floats. A header of static inline
 * functions: each kernel library gets its own copy (kernels/cpu_native.py rebuilds a kernel
 * when this file changes too). */
#ifndef PDSERVE_VEC8_H
#define PDSERVE_VEC8_H

#include <stdint.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

typedef float vf __attribute__((vector_size(32), aligned(4), may_alias));
#define VL 8

INLINE vf vload(const float *p) { return *(const vf *)p; }
INLINE void vstore(float *p, vf v) { *(vf *)p = v; }

INLINE float hsum(vf v) {
    const float a = (v[0] + v[4]) + (v[2] + v[6]), b = (v[1] + v[5]) + (v[3] + v[7]);
    return a + b;
}

/* e^x for x <= 0 (a softmax's scores less their max; SwiGLU's -|x|), 8 lanes at once: 2^n e^f
 * with n = round(x / ln 2) (x / ln 2 - 1/2, truncated), |f| <= ln 2 / 2 (ln 2 in two parts,
 * Cephes' split, so that f keeps its bits), e^f by its Taylor series to f^7 (truncation
 * below 1e-8 relative). Plain arithmetic (libm's expf is a call per element); exp_neg is one
 * lane of it. Below -87 it returns e^-87 (~1.6e-38), not 0. */
INLINE vf exp_neg_v(vf x) {
    typedef int32_t vi __attribute__((vector_size(32)));
    for (int i = 0; i < VL; i++) x[i] = x[i] < -87.0f ? -87.0f : x[i];
    const vi ni = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, vi);
    const vf n = __builtin_convertvector(ni, vf);
    const vf f = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    vf e = (vf){0} + 1.0f / 5040.0f;
    e = e * f + 1.0f / 720.0f;
    e = e * f + 1.0f / 120.0f;
    e = e * f + 1.0f / 24.0f;
    e = e * f + 1.0f / 6.0f;
    e = e * f + 0.5f;
    e = e * f + 1.0f;
    e = e * f + 1.0f;
    const vi bits = (ni + 127) << 23;
    vf scale;
    memcpy(&scale, &bits, sizeof scale);
    return e * scale;
}

INLINE float exp_neg(float x) { return exp_neg_v((vf){0} + x)[0]; }

#endif
