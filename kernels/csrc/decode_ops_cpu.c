/* The small element-wise steps of a decoder layer, one call each instead of the five to
 * ten torch ops they take (at a decode step's few rows each op is mostly its dispatch):
 *
 *   rms_norm_f32       out = w * x / sqrt(mean(x^2) + eps), per row
 *   silu_and_mul_f32   out = silu(x[:, :n]) * x[:, n:]            (SwiGLU's activation;
 *                      e^x in vectors, vec8.h, not libm's expf per element)
 *   argmax_rows_f32    out[r] = the first index of row r's largest value (of its first
 *                      NaN, if it has one), as torch.argmax (greedy sampling's pick)
 *   rope_f32           out = [x1 cos - x2 sin, x2 cos + x1 sin]    per row and head, with
 *                      (x1, x2) the two halves of the head, or its even and odd elements
 *                      (interleaved; the output is then de-interleaved, as the torch path)
 *
 * fp32; strides in elements, unit stride along the last axis. Rows go to OpenMP threads
 * only when there are enough of them to pay for waking the team (a prefill chunk).
 */
#include <math.h>
#include <stdint.h>

#include "vec8.h"

#define PARALLEL_ELEMENTS (1 << 16) /* below this many elements, one thread */

int rms_norm_f32(const float *x, int64_t ldx, const float *w, float eps, float *out,
                 int64_t ldo, int64_t rows, int64_t dim, int num_threads) {
    if (rows < 0 || dim < 1 || num_threads < 1) return 1;
#pragma omp parallel for num_threads(num_threads) if (rows * dim >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * ldx;
        float *o = out + r * ldo;
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < dim; i++) ss += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) o[i] = w[i] * (xr[i] * inv);
    }
    return 0;
}

/* g sigmoid(g) u, 8 lanes: sigmoid from e = e^-|g| (never overflows), 1 / (1 + e) where
 * g >= 0 and e / (1 + e) below. */
INLINE vf swiglu_v(const vf g, const vf u) {
    vf neg, num;
    for (int i = 0; i < VL; i++) neg[i] = g[i] < 0.0f ? g[i] : -g[i];
    const vf e = exp_neg_v(neg);
    for (int i = 0; i < VL; i++) num[i] = g[i] < 0.0f ? e[i] : 1.0f;
    return g * num / (1.0f + e) * u;
}

int silu_and_mul_f32(const float *x, int64_t ldx, float *out, int64_t ldo, int64_t rows,
                     int64_t n, int num_threads) {
    if (rows < 0 || n < 1 || num_threads < 1) return 1;
    const int64_t nv = n - n % VL;
#pragma omp parallel for num_threads(num_threads) if (rows * n >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = x + r * ldx, *u = g + n;
        float *o = out + r * ldo;
        for (int64_t i = 0; i < nv; i += VL) vstore(o + i, swiglu_v(vload(g + i), vload(u + i)));
        for (int64_t i = nv; i < n; i++)  /* the same arithmetic, one lane */
            o[i] = swiglu_v((vf){0} + g[i], (vf){0} + u[i])[0];
    }
    return 0;
}

/* x [T, H, D] with strides (ldt, ldh, 1); cos, sin [T, D / 2] with row stride ldc;
 * out [T, H, D] contiguous. */
int rope_f32(const float *x, int64_t ldt, int64_t ldh, const float *cos, const float *sin,
             int64_t ldc, float *out, int64_t tokens, int64_t heads, int64_t dim,
             int interleaved, int num_threads) {
    if (tokens < 0 || heads < 1 || dim < 2 || dim % 2 || num_threads < 1) return 1;
    const int64_t half = dim / 2, step = interleaved ? 2 : 1, second = interleaved ? 1 : half;
#pragma omp parallel for num_threads(num_threads) if (tokens * heads * dim >= PARALLEL_ELEMENTS)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * ldc, *s = sin + t * ldc;
        for (int64_t h = 0; h < heads; h++) {
            const float *xh = x + t * ldt + h * ldh;
            float *o = out + (t * heads + h) * dim;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float x1 = xh[i * step], x2 = xh[i * step + second];
                o[i] = x1 * c[i] - x2 * s[i];
                o[half + i] = x2 * c[i] + x1 * s[i];
            }
        }
    }
    return 0;
}

/* The first index of the largest of x[0..n) (of the first NaN where there is one, as
 * torch.argmax): 8 lanes, each keeping its own first largest (a strict > keeps the earlier
 * index on a tie), then the largest of the lanes with the smallest index among equals. */
static int64_t argmax_row(const float *x, int64_t n) {
    typedef int32_t vi __attribute__((vector_size(32)));
    const int64_t nv = n - n % VL;
    int64_t best = 0;
    float bestv = n ? x[0] : 0.0f;
    int nan = 0;
    if (nv) {
        vf bv = vload(x);
        vi bi = {0, 1, 2, 3, 4, 5, 6, 7}, idx = bi, nanv = {0};
        for (int64_t i = VL; i < nv; i += VL) {
            const vf v = vload(x + i);
            idx += VL;
            nanv |= v != v;
            const vi up = v > bv; /* all ones where this chunk's value is larger */
            bv = (vf)(((vi)v & up) | ((vi)bv & ~up));
            bi = (idx & up) | (bi & ~up);
        }
        nanv |= bv != bv;
        for (int l = 0; l < VL; l++) nan |= nanv[l] != 0;
        bestv = bv[0], best = bi[0];
        for (int l = 1; l < VL; l++)
            if (bv[l] > bestv || (bv[l] == bestv && bi[l] < best)) bestv = bv[l], best = bi[l];
    }
    for (int64_t i = nv; i < n; i++) {
        nan |= x[i] != x[i];
        if (x[i] > bestv) bestv = x[i], best = i;
    }
    if (nan)
        for (int64_t i = 0; i < n; i++)
            if (x[i] != x[i]) return i;
    return best;
}

int argmax_rows_f32(const float *x, int64_t ldx, int64_t rows, int64_t n, int64_t *out,
                    int num_threads) {
    if (rows < 0 || n < 1 || n > INT32_MAX || num_threads < 1) return 1;
#pragma omp parallel for num_threads(num_threads) if (rows * n >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * ldx, n);
    return 0;
}
