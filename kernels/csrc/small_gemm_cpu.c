/* y = x w^T (+ b) for the few rows a decode step multiplies: x [M, K], w [N, K] as torch
 * keeps a Linear's weight, y [M, N]; fp32.
 *
 * At a handful of rows a decode step's projections are a stream over the weights: each
 * weight is used M times, so the step is as fast as the weights can be read. This kernel
 * reads each of w's rows once, in place (no packed copy), for every row of x: a tile is
 * R weight rows multiplied with a chunk of up to MT rows of x at once (x from the caches),
 * with M x R vector accumulators summed across their lanes at the end; a thread's task is
 * a block of weight rows, each chunk of x through it in turn (past MT rows of x the block
 * is read again, from L2, not from memory). R
 * shrinks as the chunk of x grows so that the accumulators, R weight vectors and one x
 * vector about fit the register file (32 vectors with AVX-512, 16 with AVX2; at one row
 * of x the weights are used once and go straight from memory into the FMAs). Row blocks are
 * spread over OpenMP threads (the process's own runtime: torch loads libgomp.so.1 first,
 * and this library reuses it).
 *
 * Strides are in elements; rows must have unit stride along K. K needs no particular
 * multiple (a scalar tail), nor does N (the last rows go one at a time).
 */
#include <stdint.h>

#define INLINE static inline __attribute__((always_inline))

#define MT 8 /* rows of x per chunk (16 with AVX-512 measured slower: one weight row per task) */
#if defined(__AVX512F__)
#define VL 16 /* fp32 lanes in a vector */
#define ACC 16 /* accumulators a task keeps */
#else
#define VL 8
#define ACC 8
#endif

typedef float vf __attribute__((vector_size(VL * 4), aligned(4), may_alias));

INLINE vf vload(const float *p) { return *(const vf *)p; }

typedef int vi __attribute__((vector_size(VL * 4)));

/* One level of summing vectors across their lanes: a and b each hold VL / W sums, W lanes
 * apiece, side by side; the result holds a's then b's, each folded to W / 2 lanes (its two
 * halves added). Order is kept, so after log2(VL) levels lane i is the i-th vector's sum.
 * The lane indices (b's lanes count from VL) are literals, as Clang's shufflevector needs
 * them (GCC's __builtin_shuffle, with a mask built in a loop, made them at run time). */
#if defined(__clang__)
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (vi){__VA_ARGS__})
#endif
#if VL == 16
#define FOLD16(a, b) (SHUFFLE(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) + \
                      SHUFFLE(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31))
#define FOLD8(a, b) (SHUFFLE(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) + \
                     SHUFFLE(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31))
#define FOLD4(a, b) (SHUFFLE(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) + \
                     SHUFFLE(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31))
#define FOLD2(a, b) (SHUFFLE(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) + \
                     SHUFFLE(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31))
#else
#define FOLD16(a, b) FOLD8(a, b) /* no 16-lane level: never taken */
#define FOLD8(a, b) (SHUFFLE(a, b, 0, 1, 2, 3, 8, 9, 10, 11) + \
                     SHUFFLE(a, b, 4, 5, 6, 7, 12, 13, 14, 15))
#define FOLD4(a, b) (SHUFFLE(a, b, 0, 1, 4, 5, 8, 9, 12, 13) + \
                     SHUFFLE(a, b, 2, 3, 6, 7, 10, 11, 14, 15))
#define FOLD2(a, b) (SHUFFLE(a, b, 0, 2, 4, 6, 8, 10, 12, 14) + \
                     SHUFFLE(a, b, 1, 3, 5, 7, 9, 11, 13, 15))
#endif

INLINE vf fold(vf a, vf b, const int W) {
    return W == 16 ? FOLD16(a, b) : W == 8 ? FOLD8(a, b) : W == 4 ? FOLD4(a, b) : FOLD2(a, b);
}

/* Lane i: the sum of v[i]'s lanes, for i < VL (v has VL vectors, zeros past the used ones). */
INLINE vf sum_lanes(vf *v) {
#pragma GCC unroll 16
    for (int W = VL; W > 1; W /= 2) {
#pragma GCC unroll 16
        for (int i = 0; i < W / 2; i++) v[i] = fold(v[2 * i], v[2 * i + 1], W);
    }
    return v[0];
}

/* Rows n0 .. n0 + R - 1 of y, for the M rows of x starting at x. M and R are constants at
 * every call site, so the loops unroll and the accumulators live in registers. While it
 * reads its rows, a tile asks for the next R rows (the next tile's) to be on their way from
 * memory: without it the loads wait on memory between FMAs. For the last tile of a weight
 * those are past its end: a prefetch never faults, and nothing is read from them. */
INLINE void tile(const int M, const int R, const float *x, int64_t ldx, const float *w,
                 int64_t ldw, int64_t K, const float *b, float *y, int64_t ldy, int64_t n0) {
    vf acc[VL];
#pragma GCC unroll 16
    for (int i = 0; i < VL; i++) acc[i] = (vf){0};
    const float *wr = w + n0 * ldw, *next = wr + R * ldw;
    int64_t k = 0;
    for (; k + VL <= K; k += VL) {
        vf wv[ACC];
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
            wv[r] = vload(wr + r * ldw + k);
            __builtin_prefetch(next + r * ldw + k, 0, 1);
        }
#pragma GCC unroll 16
        for (int m = 0; m < M; m++) {
            const vf xv = vload(x + m * ldx + k);
#pragma GCC unroll 16
            for (int r = 0; r < R; r++) acc[m * R + r] += xv * wv[r];
        }
    }
    const vf sums = sum_lanes(acc);
#pragma GCC unroll 16
    for (int m = 0; m < M; m++) {
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) {
            float s = sums[m * R + r];
            for (int64_t t = k; t < K; t++) s += x[m * ldx + t] * wr[r * ldw + t];
            y[m * ldy + n0 + r] = s + (b ? b[n0 + r] : 0.0f);
        }
    }
}

/* One chunk of M rows of x through the weight rows [n0, n1), R at a time then one by one. */
#define CHUNK_CASE(MM)                                                                         \
    case MM: {                                                                                 \
        enum { R = ACC / MM > 8 ? 8 : (ACC / MM < 1 ? 1 : ACC / MM) };                        \
        int64_t n = n0;                                                                        \
        for (; n + R <= n1; n += R) tile(MM, R, x, ldx, w, ldw, K, b, y, ldy, n);             \
        for (; n < n1; n++) tile(MM, 1, x, ldx, w, ldw, K, b, y, ldy, n);                     \
        break;                                                                                 \
    }

static void chunk(int M, const float *x, int64_t ldx, const float *w, int64_t ldw, int64_t K,
                  const float *b, float *y, int64_t ldy, int64_t n0, int64_t n1) {
    switch (M) {
        CHUNK_CASE(1) CHUNK_CASE(2) CHUNK_CASE(3) CHUNK_CASE(4)
        CHUNK_CASE(5) CHUNK_CASE(6) CHUNK_CASE(7) CHUNK_CASE(8)
    default: break;
    }
}

/* Weight rows per task: small enough that every thread of a small projection gets work and
 * that the block stays in L2 for a second chunk of x, large enough to amortize a task. */
#define BLOCK 32

int small_gemm_f32(const float *x, int64_t ldx, const float *w, int64_t ldw, const float *b,
                   float *y, int64_t ldy, int64_t M, int64_t N, int64_t K, int num_threads) {
    if (M < 0 || N < 0 || K < 0 || num_threads < 1) return 1;
    const int64_t blocks = (N + BLOCK - 1) / BLOCK;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t i = 0; i < blocks; i++) {
        const int64_t n0 = i * BLOCK, n1 = n0 + BLOCK < N ? n0 + BLOCK : N;
        for (int64_t m = 0; m < M; m += MT) {
            const int mc = M - m < MT ? (int)(M - m) : MT;
            chunk(mc, x + m * ldx, ldx, w, ldw, K, b, y + m * ldy, ldy, n0, n1);
        }
    }
    return 0;
}

/* The fp32 lanes of this build's vectors (16 with AVX-512, 8 otherwise): for tests. */
int small_gemm_lanes(void) { return VL; }
