/* Paged attention decode on CPU: one query token per sequence against its paged KV.
 *
 * A task is a sequence and a range of its KV heads: its keys and values are read once,
 * straight from the pool's blocks (no gathered copy), block after block, for every query
 * head that shares each KV head (GQA's group; MLA's latent is one head shared by all of
 * them), with an online softmax over the blocks. With enough sequences a task takes all of
 * a sequence's heads, so each block is read front to back; with few, one head each, so
 * that every thread has work. Tasks are spread over OpenMP threads (the process's own
 * runtime: torch loads libgomp.so.1 first, and this library reuses it). fp32 throughout.
 *
 * Strides are in elements. The pool is [N, block_size, heads, dim] with any strides along
 * those axes but a unit stride along dim, which lets MLA pass its latent rows as keys and
 * their first `rank` columns as values without a copy.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

typedef struct {
    int64_t block, token, head;
} pool_strides;

typedef struct {
    const float *q;        /* [q_heads, dim] of this sequence */
    const float *k, *v;    /* pool bases */
    pool_strides ks, vs;
    const int32_t *table;  /* this sequence's blocks */
    int64_t context, group, block_size;
    float scale;
    float *out;            /* [q_heads, vdim] of this sequence */
} task;

INLINE float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* KV heads [h0, h1) of one sequence. `work` holds, per query head of the range, a running
 * max, a running sum, a block of scores and an accumulator. Inlined into the wrappers
 * below, which fix common head sizes at compile time so that the inner loops are
 * straight-line vector code. */
INLINE void attend(const task *t, int64_t h0, int64_t h1, int64_t dim, int64_t vdim,
                   float *work) {
    const int64_t group = t->group, bs = t->block_size, heads = (h1 - h0) * group;
    float *m = work, *l = m + heads, *p = l + heads, *acc = p + heads * bs;
    for (int64_t j = 0; j < heads; j++) {
        m[j] = -FLT_MAX;
        l[j] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * heads * vdim);
    const int64_t nblocks = (t->context + bs - 1) / bs;
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t blk = t->table[b];
        const int64_t n = (b == nblocks - 1) ? t->context - b * bs : bs;
        for (int64_t h = h0; h < h1; h++) {
            const float *kb = t->k + blk * t->ks.block + h * t->ks.head;
            const float *vb = t->v + blk * t->vs.block + h * t->vs.head;
            for (int64_t g = 0; g < group; g++) {
                const int64_t j = (h - h0) * group + g; /* within the range */
                const float *restrict qj = t->q + (h * group + g) * dim;
                float *restrict pj = p + j * bs;
                float mx = m[j];
                for (int64_t i = 0; i < n; i++) {
                    const float s = dot(qj, kb + i * t->ks.token, dim) * t->scale;
                    pj[i] = s;
                    mx = s > mx ? s : mx;
                }
                const float corr = expf(m[j] - mx); /* 0 on the first block */
                float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                for (int64_t i = 0; i < n; i++) {
                    pj[i] = expf(pj[i] - mx);
                    sum += pj[i];
                }
                l[j] = l[j] * corr + sum;
                m[j] = mx;
                float *restrict aj = acc + j * vdim;
#pragma omp simd
                for (int64_t d = 0; d < vdim; d++) aj[d] *= corr;
                for (int64_t i = 0; i < n; i++) {
                    const float w = pj[i];
                    const float *restrict vi = vb + i * t->vs.token;
#pragma omp simd
                    for (int64_t d = 0; d < vdim; d++) aj[d] += w * vi[d];
                }
            }
        }
    }
    for (int64_t j = 0; j < heads; j++) {
        const float inv = l[j] > 0.0f ? 1.0f / l[j] : 0.0f;
        float *oj = t->out + (h0 * group + j) * vdim;
        const float *aj = acc + j * vdim;
        for (int64_t d = 0; d < vdim; d++) oj[d] = aj[d] * inv;
    }
}

#define ATTEND_FIXED(D, DV)                                                              \
    static void attend_##D##_##DV(const task *t, int64_t h0, int64_t h1, float *work) { \
        attend(t, h0, h1, D, DV, work);                                                  \
    }
ATTEND_FIXED(64, 64)
ATTEND_FIXED(128, 128)
ATTEND_FIXED(576, 512) /* DeepSeek's MLA: latent 512 + rope 64 */

static void attend_any(const task *t, int64_t h0, int64_t h1, int64_t dim, int64_t vdim,
                       float *work) {
    if (dim == 64 && vdim == 64)
        attend_64_64(t, h0, h1, work);
    else if (dim == 128 && vdim == 128)
        attend_128_128(t, h0, h1, work);
    else if (dim == 576 && vdim == 512)
        attend_576_512(t, h0, h1, work);
    else
        attend(t, h0, h1, dim, vdim, work);
}

/* q [batch, q_heads, dim] and out [batch, q_heads, vdim], both contiguous; block_tables
 * [batch, table_stride] int32; context_lens [batch] int32 (0: the output row is zeros).
 * Returns 0, or -1 if a work buffer could not be allocated. */
int paged_gqa_decode_f32(const float *q, const float *k_cache, int64_t k_block,
                         int64_t k_token, int64_t k_head, const float *v_cache,
                         int64_t v_block, int64_t v_token, int64_t v_head,
                         const int32_t *block_tables, int64_t table_stride,
                         const int32_t *context_lens, float *out, int64_t batch,
                         int64_t q_heads, int64_t kv_heads, int64_t dim, int64_t vdim,
                         int64_t block_size, float scale, int num_threads) {
    const pool_strides ks = {k_block, k_token, k_head}, vs = {v_block, v_token, v_head};
    const int64_t group = q_heads / kv_heads;
    /* whole sequences when there are several per thread, else one KV head per task */
    const int64_t per_task = batch >= 4 * (int64_t)num_threads ? kv_heads : 1;
    const int64_t tasks_per_seq = kv_heads / per_task;
    const int64_t heads = per_task * group;
    const int64_t work_floats = heads * (2 + block_size + vdim);
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *work = malloc(sizeof(float) * work_floats);
        if (!work) failed = 1;
#pragma omp for schedule(dynamic)
        for (int64_t i = 0; i < batch * tasks_per_seq; i++) {
            if (!work) continue;
            const int64_t s = i / tasks_per_seq, h0 = (i % tasks_per_seq) * per_task;
            const task t = {q + s * q_heads * dim, k_cache, v_cache, ks, vs,
                            block_tables + s * table_stride, context_lens[s], group,
                            block_size, scale, out + s * q_heads * vdim};
            if (t.context <= 0)
                memset(t.out + h0 * group * vdim, 0, sizeof(float) * heads * vdim);
            else
                attend_any(&t, h0, h0 + per_task, dim, vdim, work);
        }
        free(work);
    }
    return failed ? -1 : 0;
}
