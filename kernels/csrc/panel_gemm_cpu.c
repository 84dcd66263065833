/* y = x w^T (+ b) in fp32 for any number of rows of x, with w packed once (when the model
 * loads) into panels of NR of its rows laid out K-major: [ceil(N / NR)][K][NR], the last
 * panel padded with zero rows. This is the outer-product form of the product, as BLAS
 * libraries compute it: a tile of up to MR rows of x by one panel keeps MR x NR sums in
 * vector registers, and each step k loads the panel's NR weights (two vectors, contiguous)
 * and multiplies them by each of the tile's x values of that k, broadcast. No sums across
 * lanes at the end; the panels lie one after another, so that a thread reads its share of
 * the weights as one stream (which the hardware's prefetchers follow: one row of x runs
 * at the machine's read bandwidth), each panel once from memory, its other tiles rereading
 * it from the caches. x is packed per call into micro-panels of MR rows, K-major too
 * ([ceil(M / MR)][K][MR]), so that a tile's broadcasts at one k come from one line.
 *
 * Tiles are spread over OpenMP threads in contiguous ranges of (panel, micro-panel) (the
 * process's own runtime: torch loads libgomp.so.1 first, and this library reuses it). Past
 * ROW_BLOCK micro-panels of x, a block of them goes through all the panels before the next
 * block (the weights read once per block, the block's x from the caches).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

#if defined(__AVX512F__)
#define VL 16 /* fp32 lanes in a vector */
#define MR 14 /* 28 accumulators, 2 weight vectors and a broadcast: 31 of 32 registers */
#else
#define VL 8
#define MR 6 /* 12 accumulators + 2 + 1 of 16 */
#endif
#define NR (2 * VL)
#define ROW_BLOCK 16

typedef float vf __attribute__((vector_size(VL * 4), aligned(4), may_alias));

INLINE vf vload(const float *p) { return *(const vf *)p; }

/* Weight rows per panel (twice this build's vector lanes): for the packed size and tests. */
int panel_gemm_nr(void) { return NR; }

/* Rows of x per tile: for tests. */
int panel_gemm_mr(void) { return MR; }

/* w [N, K] (rows `ldw` apart, unit stride along K) into wp, which holds
 * ceil(N / NR) * NR * K floats. */
void panel_gemm_pack(const float *w, int64_t ldw, int64_t N, int64_t K, float *wp,
                     int num_threads) {
    const int64_t panels = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < panels; p++) {
        float *dst = wp + p * K * NR;
        for (int64_t k = 0; k < K; k++)
            for (int64_t j = 0; j < NR; j++) {
                const int64_t n = p * NR + j;
                dst[k * NR + j] = n < N ? w[n * ldw + k] : 0.0f;
            }
    }
}

/* One tile: m (<= MR; a constant at each call, so that the loops unroll and the sums stay
 * in registers) rows of packed x by one panel, into y's rows (`ldy` apart) at column n0,
 * of which `cols` (<= NR) are real. */
INLINE void tile(const int m, const float *xp, const float *panel, const int64_t K,
                 const float *b, float *y, const int64_t ldy, const int64_t n0,
                 const int64_t cols) {
    vf acc[MR][2];
#pragma GCC unroll 14
    for (int i = 0; i < m; i++) acc[i][0] = acc[i][1] = (vf){0};
#pragma GCC unroll 2
    for (int64_t k = 0; k < K; k++) {
        const vf w0 = vload(panel + k * NR), w1 = vload(panel + k * NR + VL);
#pragma GCC unroll 14
        for (int i = 0; i < m; i++) {
            const float xi = xp[k * m + i];
            acc[i][0] += xi * w0;
            acc[i][1] += xi * w1;
        }
    }
    float bias[NR] = {0};
    if (b) memcpy(bias, b + n0, sizeof(float) * cols);
    const vf b0 = vload(bias), b1 = vload(bias + VL);
#pragma GCC unroll 14
    for (int i = 0; i < m; i++) {
        acc[i][0] += b0;
        acc[i][1] += b1;
    }
    if (cols == NR) {
#pragma GCC unroll 14
        for (int i = 0; i < m; i++) {
            *(vf *)(y + i * ldy + n0) = acc[i][0];
            *(vf *)(y + i * ldy + n0 + VL) = acc[i][1];
        }
    } else { /* the last panel: only its real columns */
        for (int i = 0; i < m; i++) {
            float row[NR];
            memcpy(row, &acc[i][0], sizeof(vf));
            memcpy(row + VL, &acc[i][1], sizeof(vf));
            memcpy(y + i * ldy + n0, row, sizeof(float) * cols);
        }
    }
}

#define TILE_CASE(MM) \
    case MM: tile(MM, xp, panel, K, b, y, ldy, n0, cols); break;

static void tile_any(int m, const float *xp, const float *panel, int64_t K, const float *b,
                     float *y, int64_t ldy, int64_t n0, int64_t cols) {
    switch (m) {
        TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4) TILE_CASE(5) TILE_CASE(6)
#if MR > 6
        TILE_CASE(7) TILE_CASE(8) TILE_CASE(9) TILE_CASE(10) TILE_CASE(11) TILE_CASE(12)
        TILE_CASE(13) TILE_CASE(14)
#endif
    default: break;
    }
}

/* y [M, N] (rows `ldy` apart) = x [M, K] (rows `ldx` apart, unit stride along K) w^T
 * (+ b [N]), w packed by panel_gemm_pack. Returns 0; 1 for bad sizes; 2 if the packed copy
 * of x could not be allocated. */
int panel_gemm_f32(const float *x, int64_t ldx, const float *wp, const float *b, float *y,
                   int64_t ldy, int64_t M, int64_t N, int64_t K, int num_threads) {
    if (M < 0 || N < 0 || K < 1 || num_threads < 1) return 1;
    if (M == 0 || N == 0) return 0;
    const int64_t chunks = (M + MR - 1) / MR, panels = (N + NR - 1) / NR;
    float *xp = malloc(sizeof(float) * chunks * MR * K);
    if (!xp) return 2;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t m0 = c * MR, m = M - m0 < MR ? M - m0 : MR;
            float *dst = xp + c * MR * K;
            for (int64_t k = 0; k < K; k++)
                for (int64_t i = 0; i < m; i++) dst[k * m + i] = x[(m0 + i) * ldx + k];
        }
        for (int64_t c0 = 0; c0 < chunks; c0 += ROW_BLOCK) {
            const int64_t c1 = c0 + ROW_BLOCK < chunks ? c0 + ROW_BLOCK : chunks;
            /* tiles in (panel, micro-panel) order, in contiguous ranges: a thread takes
             * whole panels while there are more panels than threads, else splits them */
#pragma omp for collapse(2) schedule(static)
            for (int64_t p = 0; p < panels; p++)
                for (int64_t c = c0; c < c1; c++) {
                    const int64_t n0 = p * NR, cols = N - n0 < NR ? N - n0 : NR;
                    const int64_t m0 = c * MR, m = M - m0 < MR ? M - m0 : MR;
                    tile_any((int)m, xp + c * MR * K, wp + p * K * NR, K, b, y + m0 * ldy,
                             ldy, n0, cols);
                }
        }
    }
    free(xp);
    return 0;
}
