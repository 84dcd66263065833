/* Paged attention decode on CPU: one query token per sequence against its paged KV.
 *
 * A task is a sequence and a range of its KV heads: its keys and values are read once,
 * straight from the pool's blocks (no gathered copy), block after block, for every query
 * head that shares each KV head (GQA's group; MLA's latent is one head shared by all of
 * them), with an online softmax over the blocks. With enough sequences a task takes all of
 * a sequence's heads, so each block is read front to back; with few, one head each, so
 * that every thread has work. A block goes eight rows at a time, every head of the task
 * within those rows, so that its keys and then its values are read front to back (what
 * the hardware's stream prefetchers follow; a whole block a head at a time strides through
 * it once per head). Within a KV head, up to four query heads go through the rows together,
 * so that each key and value row is loaded once for all of them, in 8-lane vectors: scores
 * a chunk of keys at a time (their sums reduced together, not one horizontal sum per key),
 * then the softmax's exponentials, then the weighted values. Tasks are
 * spread over OpenMP threads (the process's own runtime: torch loads libgomp.so.1 first,
 * and this library reuses it). fp32 throughout.
 *
 * Strides are in elements. The pool is [N, block_size, heads, dim] with any strides along
 * those axes but a unit stride along dim, which lets MLA pass its latent rows as keys and
 * their first `rank` columns as values without a copy.
 */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec8.h"

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

#define GT 4 /* query heads that share one pass over a block's keys and values */

/* Keys per chunk of the scores and query heads per pass over a chunk: the chunk's partial
 * sums (SG x KT vectors) stay in registers, 32 of them where AVX-512 gives 32 vector
 * registers, 16 elsewhere. */
#if defined(__AVX512F__)
#define KT 8
#define SG 3
#else
#define KT 4
#define SG 2
#endif

typedef float vf4 __attribute__((vector_size(16), aligned(4), may_alias));

#define EVENS(x, y) __builtin_shufflevector(x, y, 0, 2, 8, 10, 4, 6, 12, 14)
#define ODDS(x, y) __builtin_shufflevector(x, y, 1, 3, 9, 11, 5, 7, 13, 15)

/* a[k]'s lanes summed, for k < 4: lanes 0-3 of the result (pairs, then quads, then the
 * two halves). */
INLINE vf4 reduce4(const vf *a) {
    const vf h01 = EVENS(a[0], a[1]) + ODDS(a[0], a[1]);
    const vf h23 = EVENS(a[2], a[3]) + ODDS(a[2], a[3]);
    const vf s = EVENS(h01, h23) + ODDS(h01, h23); /* [quads of lanes 0-3 | of lanes 4-7] */
    return __builtin_shufflevector(s, s, 0, 1, 2, 3) + __builtin_shufflevector(s, s, 4, 5, 6, 7);
}

/* Scores of `gt` query heads (rows of q, `dim` apart) against n keys `kst` apart, into
 * rows of p `bs` apart. Keys go KT at a time: each key vector is loaded once for up to SG
 * heads, each query vector once per chunk, and a chunk's sums are reduced together (a
 * transpose of adds) instead of one horizontal sum per key; keys past the last whole chunk
 * (a context's end) one at a time. The order of the adds depends on the key's place in
 * its block and on where the context ends, never on the task split. */
INLINE void scores_tile(const float *restrict q, const int gt, const int64_t dim,
                        const float *kb, const int64_t kst, const int64_t n, const float scale,
                        float *restrict p, const int64_t bs) {
    const int64_t dv = dim - dim % VL;
    int64_t i = 0;
    for (; i + KT <= n && dv == dim; i += KT)
        for (int g0 = 0; g0 < gt; g0 += SG) {
            const int sg = gt - g0 < SG ? gt - g0 : SG;
            vf a[SG][KT];
            for (int g = 0; g < sg; g++)
                for (int k = 0; k < KT; k++) a[g][k] = (vf){0};
            for (int64_t d = 0; d < dv; d += VL) {
                vf qv[SG];
                for (int g = 0; g < sg; g++) qv[g] = vload(q + (g0 + g) * dim + d);
                for (int k = 0; k < KT; k++) {
                    const vf kv = vload(kb + (i + k) * kst + d);
                    for (int g = 0; g < sg; g++) a[g][k] += qv[g] * kv;
                }
            }
            for (int g = 0; g < sg; g++)
                for (int k = 0; k < KT; k += 4) {
                    const vf4 s = reduce4(&a[g][k]) * scale;
                    memcpy(p + (g0 + g) * bs + i + k, &s, sizeof s);
                }
        }
    for (; i < n; i++) { /* the block's last keys (a context's end), one at a time */
        const float *kr = kb + i * kst;
        for (int g = 0; g < gt; g++) {
            vf a = (vf){0};
            for (int64_t d = 0; d < dv; d += VL) a += vload(q + g * dim + d) * vload(kr + d);
            float s = hsum(a);
            for (int64_t d = dv; d < dim; d++) s += q[g * dim + d] * kr[d];
            p[g * bs + i] = s * scale;
        }
    }
}

/* acc[g] += sum_i p[g][i] v_i for `gt` heads: 16 columns at a time, held in registers over
 * the block's n values rows, each row loaded once for all heads. */
INLINE void values_tile(const float *restrict p, const int gt, const int64_t bs,
                        const float *vb, const int64_t vst, const int64_t n,
                        const int64_t vdim, float *restrict acc) {
    const int64_t dv = vdim - vdim % (2 * VL);
    for (int64_t d = 0; d < dv; d += 2 * VL) {
        vf a0[GT], a1[GT];
        for (int g = 0; g < gt; g++) {
            a0[g] = vload(acc + g * vdim + d);
            a1[g] = vload(acc + g * vdim + d + VL);
        }
        for (int64_t i = 0; i < n; i++) {
            const vf v0 = vload(vb + i * vst + d), v1 = vload(vb + i * vst + d + VL);
            for (int g = 0; g < gt; g++) {
                const float w = p[g * bs + i];
                a0[g] += w * v0;
                a1[g] += w * v1;
            }
        }
        for (int g = 0; g < gt; g++) {
            vstore(acc + g * vdim + d, a0[g]);
            vstore(acc + g * vdim + d + VL, a1[g]);
        }
    }
    for (int64_t d = dv; d < vdim; d++)
        for (int g = 0; g < gt; g++) {
            float s = acc[g * vdim + d];
            for (int64_t i = 0; i < n; i++) s += p[g * bs + i] * vb[i * vst + d];
            acc[g * vdim + d] = s;
        }
}

/* The online softmax's step for one head over a block's n scores: p becomes the weights,
 * the running max m, sum l and accumulator acc are rescaled. Whole vectors of scores go
 * VL at a time, the rest one by one, with the same arithmetic. */
INLINE void softmax_step(float *restrict p, const int64_t n, float *m, float *l,
                         float *restrict acc, const int64_t vdim) {
    const int64_t nv = n - n % VL;
    float mx = *m;
    if (nv) {
        vf vm = vload(p);
        for (int64_t i = VL; i < nv; i += VL) {
            const vf x = vload(p + i);
            for (int k = 0; k < VL; k++) vm[k] = x[k] > vm[k] ? x[k] : vm[k];
        }
        for (int i = 0; i < VL; i++) mx = vm[i] > mx ? vm[i] : mx;
    }
    for (int64_t i = nv; i < n; i++) mx = p[i] > mx ? p[i] : mx;
    vf vs = (vf){0};
    for (int64_t i = 0; i < nv; i += VL) {
        const vf e = exp_neg_v(vload(p + i) - mx);
        vstore(p + i, e);
        vs += e;
    }
    float sum = hsum(vs);
    for (int64_t i = nv; i < n; i++) {
        p[i] = exp_neg(p[i] - mx);
        sum += p[i];
    }
    if (mx == *m) { /* the running max held (most blocks past the first few): no rescale */
        *l += sum;
        return;
    }
    const float corr = exp_neg(*m - mx); /* ~0 on the first block, where acc and l are 0 */
    *l = *l * corr + sum;
    *m = mx;
    const int64_t dv = vdim - vdim % VL;
    for (int64_t d = 0; d < dv; d += VL) vstore(acc + d, vload(acc + d) * corr);
    for (int64_t d = dv; d < vdim; d++) acc[d] *= corr;
}

#define RC 8 /* rows of a block per chunk, every head of the task within the chunk */

/* The query heads [qh, qh + gt) of KV head h over rows [i0, i0 + rc) of a block. */
#define TILE_SWITCH(call)                                                             \
    switch (group - g0 < GT ? group - g0 : GT) {                                      \
    case 1: call(1); break;                                                           \
    case 2: call(2); break;                                                           \
    case 3: call(3); break;                                                           \
    default: call(4); break;                                                          \
    }

/* One block for KV heads [h0, h1): scores of every query head, then each head's online
 * softmax step, then the weighted values. */
INLINE void block_pass(const task *t, const int64_t blk, const int64_t n, const int64_t h0,
                       const int64_t h1, const int64_t dim, const int64_t vdim, float *m,
                       float *l, float *p, float *acc) {
    const int64_t bs = t->block_size, group = t->group;
    const float *kblk = t->k + blk * t->ks.block, *vblk = t->v + blk * t->vs.block;
    for (int64_t i0 = 0; i0 < n; i0 += RC) {
        const int64_t rc = n - i0 < RC ? n - i0 : RC;
        for (int64_t h = h0; h < h1; h++)
            for (int64_t g0 = 0; g0 < group; g0 += GT) {
                const int64_t qh = h * group + g0, j = (h - h0) * group + g0;
                const float *kb = kblk + i0 * t->ks.token + h * t->ks.head;
#define SCORES(gt) \
    scores_tile(t->q + qh * dim, gt, dim, kb, t->ks.token, rc, t->scale, p + j * bs + i0, bs)
                TILE_SWITCH(SCORES)
#undef SCORES
            }
    }
    for (int64_t j = 0; j < (h1 - h0) * group; j++)
        softmax_step(p + j * bs, n, m + j, l + j, acc + j * vdim, vdim);
    for (int64_t i0 = 0; i0 < n; i0 += RC) {
        const int64_t rc = n - i0 < RC ? n - i0 : RC;
        for (int64_t h = h0; h < h1; h++)
            for (int64_t g0 = 0; g0 < group; g0 += GT) {
                const int64_t j = (h - h0) * group + g0;
                const float *vb = vblk + i0 * t->vs.token + h * t->vs.head;
#define VALUES(gt) \
    values_tile(p + j * bs + i0, gt, bs, vb, t->vs.token, rc, vdim, acc + j * vdim)
                TILE_SWITCH(VALUES)
#undef VALUES
            }
    }
}

/* Asks for the keys and values of heads [h0, h1) of the block after next while this one
 * is computed (into the outer caches: hint 1): blocks lie anywhere in the pool, so the
 * hardware's stream prefetchers restart at every block. Measured on 2 cores with 200 MB of
 * shuffled blocks: 8 GB/s without, 11-13 with, as with blocks in order. */
INLINE void prefetch_block(const task *t, const int64_t blk, const int64_t h0, const int64_t h1,
                           const int64_t dim, const int64_t vdim) {
    for (int64_t i = 0; i < t->block_size; i++)
        for (int64_t h = h0; h < h1; h++) {
            const float *kr = t->k + blk * t->ks.block + i * t->ks.token + h * t->ks.head;
            const float *vr = t->v + blk * t->vs.block + i * t->vs.token + h * t->vs.head;
            for (int64_t d = 0; d < dim; d += 16) __builtin_prefetch(kr + d, 0, 1);
            for (int64_t d = 0; d < vdim; d += 16) __builtin_prefetch(vr + d, 0, 1);
        }
}

/* KV heads [h0, h1) of one sequence. `work` holds, per query head of the range, a running
 * max, a running sum, a block of scores and an accumulator. Inlined into the wrappers
 * below, which fix common head sizes at compile time so that the inner loops are
 * straight-line vector code. A head's arithmetic does not depend on the range or on the
 * other heads of its tile, so every task split gives the same bits. */
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
        if (b + 2 < nblocks) prefetch_block(t, t->table[b + 2], h0, h1, dim, vdim);
        block_pass(t, blk, n, h0, h1, dim, vdim, m, l, p, acc);
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
