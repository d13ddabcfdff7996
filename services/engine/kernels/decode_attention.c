/* Paged decode attention for pdmesh's CPU engine.
 *
 * One decode row per request: its query heads attend over the request's own K/V, read
 * where they lie (a page table into the KV pool, or one contiguous cache), with no gather
 * copy. Every request (all its KV heads) is computed start to end by one thread in a fixed
 * order that depends only on the request's length and the head geometry, so a request's
 * bits never depend on the batch, on which thread ran it, or on how its pages are laid out
 * (paged engine and contiguous reference engine get the same bits: invariant I4).
 *
 * A sliding window (`window` > 0) limits a request to its last `window` keys.
 *
 * Layout of one page (or of a contiguous cache with page_tokens = its capacity and one
 * page): [layers][2 (K, V)][page_tokens][kv_heads][head_dim] floats.
 *
 * Built by services/engine/native.py with the machine's C compiler (-fopenmp); no libm.
 */
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec_exp.h"

#define LANES 16

typedef struct {
    int64_t n_seg, layer, kv_heads, group, head_dim;
    const int64_t *bases;        /* per segment: address of its storage (floats) */
    const int64_t *page_tokens;  /* per segment: tokens per page */
    const int64_t *page_stride;  /* per segment: floats between pages */
    const int64_t *page_start;   /* n_seg + 1 offsets into pages */
    const int64_t *pages;        /* page ids */
    const int64_t *lengths;      /* per segment: keys to attend over */
    const float *q;              /* [n_seg][kv_heads * group][head_dim] */
    float *out;                  /* same shape as q */
    float scale;
    int64_t window;              /* > 0: only the last `window` keys (sliding window) */
} job_t;

/* 8 floats, loaded and stored unaligned: AVX on x86-64, two SSE halves or NEON elsewhere */
typedef float v8 __attribute__((vector_size(32), aligned(4)));
#define MAX_GROUP 16
#define MAX_CHUNKS 32 /* head_dim <= 256, a multiple of 8 */
#define MAX_HEADS 256 /* query heads */

typedef int v8i __attribute__((vector_size(32)));

/* pair(a, b): lanes [a0+a1, b0+b1, a2+a3, b2+b3, a4+a5, b4+b5, a6+a7, b6+b7] */
static inline v8 pair_sums(v8 a, v8 b) {
    return __builtin_shuffle(a, b, (v8i){0, 8, 2, 10, 4, 12, 6, 14})
           + __builtin_shuffle(a, b, (v8i){1, 9, 3, 11, 5, 13, 7, 15});
}

/* Lane j of the result is the sum of the 8 lanes of a[j], always in the same tree
 * ((a0+a1)+(a2+a3))+((a4+a5)+(a6+a7)), whatever the other vectors hold. */
static inline v8 transpose_sums(const v8 *a) {
    const v8 b0 = pair_sums(a[0], a[1]), b1 = pair_sums(a[2], a[3]);
    const v8 b2 = pair_sums(a[4], a[5]), b3 = pair_sums(a[6], a[7]);
    const v8 c0 = __builtin_shuffle(b0, b1, (v8i){0, 1, 8, 9, 4, 5, 12, 13})
                  + __builtin_shuffle(b0, b1, (v8i){2, 3, 10, 11, 6, 7, 14, 15});
    const v8 c1 = __builtin_shuffle(b2, b3, (v8i){0, 1, 8, 9, 4, 5, 12, 13})
                  + __builtin_shuffle(b2, b3, (v8i){2, 3, 10, 11, 6, 7, 14, 15});
    return __builtin_shuffle(c0, c1, (v8i){0, 1, 2, 3, 8, 9, 10, 11})
           + __builtin_shuffle(c0, c1, (v8i){4, 5, 6, 7, 12, 13, 14, 15});
}

static inline float lane_sum(const float *acc) {
    /* fixed pairwise tree over the 16 lanes */
    float t[8];
    for (int j = 0; j < 8; j++) t[j] = acc[j] + acc[j + 8];
    for (int j = 0; j < 4; j++) t[j] = t[j] + t[j + 4];
    return (t[0] + t[2]) + (t[1] + t[3]);
}

/* Ask for `floats` floats from `p` on, one cache line at a time, into L2 (a page's block
 * of one layer is contiguous; the hardware prefetcher stops at every 4 KiB boundary).
 * Into L1 (locality 3) the requests ahead evicted the lines being computed on: tiny's
 * paged attention took 1.8x its contiguous twin's time, 1.2-1.35x into L2. */
static inline void prefetch_block(const float *p, int64_t floats) {
    for (int64_t i = 0; i < floats; i += 16) __builtin_prefetch(p + i, 0, 2);
}

/* How far ahead to ask for pages: PREFETCH_PAGES pages of one layer's K (or V) blocks.
 * A page's block of one layer is small (4 KB for a 16-token page of 2 KV heads of 64 B)
 * and the next one lies a whole page (every layer) further, so the hardware prefetcher,
 * which stops at each 4 KiB boundary, cannot run ahead by itself. Measured in a decode
 * step (tiny, 2 threads, one process, interleaved): 2 pages beat 1, 3, 4 and "32 KB" (8
 * of tiny's pages) at batch 1 and 16 (paged/contiguous 0.93 against 0.88-0.90 at 16;
 * SmolLM2's 12 KB blocks made 32 KB two pages already). */
#ifndef PREFETCH_PAGES
#define PREFETCH_PAGES 2
#endif

/* While page `pi` computes, ask for the same block `ahead` pages on (and, at the first
 * page, for pages 1 .. ahead - 1 too), a few lines at a time spread over the page's
 * compute (`pf_some` per block of work), not as one burst at the page's start, which
 * stalls the core on its fill buffers. `block` is the storage base plus the block's offset inside a page. */
typedef struct { const float *p; int64_t left; } pf_cursor;

static inline pf_cursor pf_page(const float *block, const int64_t *pages, int64_t pi,
                                int64_t length, int64_t ptok, int64_t stride, int64_t kvw,
                                int64_t ahead) {
    const int64_t count = (length + ptok - 1) / ptok;
    pf_cursor cur = {block, 0};
    if (ahead <= 0) return cur;
    if (pi == 0)
        for (int64_t p = 1; p < ahead && p < count; p++)
            prefetch_block(block + pages[p] * stride, ptok * kvw);
    if (pi + ahead < count) {
        cur.p = block + pages[pi + ahead] * stride;
        cur.left = ptok * kvw;
    }
    return cur;
}

static inline void pf_some(pf_cursor *cur, int64_t lines) {
    for (int64_t i = 0; i < lines && cur->left > 0; i++) {
        __builtin_prefetch(cur->p, 0, 2);
        cur->p += 16;
        cur->left -= 16;
    }
}

/* Store a block's 8 dots: whole, or its first m lanes where the row has no room. */
static inline void put8(float *dst, v8 dots, int whole, int64_t m) {
    if (whole)
        *(v8 *)dst = dots;
    else
        for (int64_t j = 0; j < m; j++) dst[j] = dots[j];
}

/* vmax and exp8: exp(x) for x <= 0 (scores minus their max), eight lanes at a time */
PD_VEC_EXP(v8, v8i, vmax, exp8)

/* One request, every KV head: the body is inlined with constant (group, chunks) for the
 * common head shapes so that a head's queries and accumulators live in registers (the
 * arithmetic, hence the bits, is the same either way). K and V are walked page by page: a
 * page's block of one layer (page_tokens x kv_heads x head_dim floats, contiguous) comes
 * from memory once and is then read from L1 for each KV head. */
static inline __attribute__((always_inline)) void
attend_body(const job_t *job, int64_t seg, float *restrict scores, const int64_t group,
            const int64_t chunks) {
    const int64_t hd = chunks * 8, kv_heads = job->kv_heads, kvw = kv_heads * hd;
    const int64_t length = job->lengths[seg], ptok = job->page_tokens[seg];
    const int64_t stride = job->page_stride[seg];
    const float *base = (const float *)(intptr_t)job->bases[seg];
    const int64_t *pages = job->pages + job->page_start[seg];
    const int64_t k_off = job->layer * 2 * ptok * kvw, v_off = k_off + ptok * kvw;
    const float *q = job->q + seg * kv_heads * group * hd;
    float *out = job->out + seg * kv_heads * group * hd;
    const float scale = job->scale;
    const int64_t stride_s = (length + 15) / 16 * 16;  /* a score row, padded */
    const int64_t ahead = PREFETCH_PAGES;
    /* Keys lo..length (a sliding window); pages wholly before lo are not read. The
     * scores and sums below run from t0, lo's 16-key block, with the keys before lo
     * weighing nothing: the same bits whatever the pages (a contiguous cache is one). */
    const int64_t window = job->window;
    const int64_t lo = window > 0 && length > window ? length - window : 0;  /* guard: window-decode-native */
    const int64_t t0 = lo / 16 * 16;

    /* scores[(h * group + g) * stride_s + t] = q . k * scale */
    for (int64_t first = 0, pi = 0; first < length; first += ptok, pi++) {
        if (first + ptok <= lo) continue;
        const float *kp = base + pages[pi] * stride + k_off;
        const int64_t n = length - first < ptok ? length - first : ptok;
        /* the next K block's lines, shared out over this page's kv_heads x blocks */
        pf_cursor kcur = pf_page(base + k_off, pages, pi, length, ptok, stride, kvw, ahead);
        const int64_t kper = ((ptok * kvw + 15) / 16 + kv_heads * ((n + 7) / 8) - 1)
                             / (kv_heads * ((n + 7) / 8));
        for (int64_t h = 0; h < kv_heads; h++) {
            v8 qv[MAX_GROUP][MAX_CHUNKS];
            for (int64_t g = 0; g < group; g++)
                for (int64_t c = 0; c < chunks; c++)
                    qv[g][c] = *(const v8 *)(q + (h * group + g) * hd + 8 * c);
            const float *kh = kp + h * hd;
            float *sc = scores + h * group * stride_s + first;
            /* 8 tokens at a time: 8 independent accumulators per query row, then one
             * transposed reduction; one code path, so a token's dot is the same wherever
             * its block starts. Two query rows at a time share each K load. The 8 dots
             * are stored whole where the padded score row has room (always when a page
             * holds a multiple of 8 tokens): lanes past a tail block's end land at
             * positions >= length, which the padding below overwrites. */
            for (int64_t s0 = 0; s0 < n; s0 += 8) {
                pf_some(&kcur, kper);
                const int64_t m = n - s0 < 8 ? n - s0 : 8;
                const int whole = first + s0 + 8 <= stride_s;
                const float *row[8];
                for (int j = 0; j < 8; j++)  /* a tail block reads its last row again */
                    row[j] = kh + (s0 + (j < m ? j : m - 1)) * kvw;
                int64_t g = 0;
                for (; g + 1 < group; g += 2) {
                    v8 acc[8], acc2[8];
                    for (int j = 0; j < 8; j++) acc[j] = acc2[j] = (v8){0};
                    for (int64_t c = 0; c < chunks; c++)
                        for (int j = 0; j < 8; j++) {
                            const v8 k = *(const v8 *)(row[j] + 8 * c);
                            acc[j] += qv[g][c] * k;
                            acc2[j] += qv[g + 1][c] * k;
                        }
                    put8(sc + g * stride_s + s0, transpose_sums(acc) * scale, whole, m);
                    put8(sc + (g + 1) * stride_s + s0, transpose_sums(acc2) * scale, whole,
                         m);
                }
                if (g < group) {
                    v8 acc[8];
                    for (int j = 0; j < 8; j++) acc[j] = (v8){0};
                    for (int64_t c = 0; c < chunks; c++)
                        for (int j = 0; j < 8; j++)
                            acc[j] += qv[g][c] * *(const v8 *)(row[j] + 8 * c);
                    put8(sc + g * stride_s + s0, transpose_sums(acc) * scale, whole, m);
                }
            }
        }
    }
    float inv_sum[MAX_HEADS];
    for (int64_t r = 0; r < kv_heads * group; r++) {
        float *s = scores + r * stride_s;
        for (int64_t t = length; t < stride_s; t++) s[t] = s[length - 1];  /* pad */
        for (int64_t t = t0; t < lo; t++) s[t] = s[length - 1];  /* outside the window */
        v8 top = *(v8 *)(s + t0);
        for (int64_t t = t0 + 8; t < stride_s; t += 8) top = vmax(top, *(v8 *)(s + t));
        float m = top[0];
        for (int j = 1; j < 8; j++) m = top[j] > m ? top[j] : m;
        v8 acc0 = (v8){0}, acc1 = (v8){0};
        for (int64_t t = t0; t < stride_s; t += 16) {
            v8 e0 = exp8(*(v8 *)(s + t) - m), e1 = exp8(*(v8 *)(s + t + 8) - m);
            if (t + 16 > length || t < lo) {  /* the padding and keys before lo weigh nothing */
                for (int j = 0; j < 8; j++) {
                    if (t + j >= length || t + j < lo) e0[j] = 0.0f;
                    if (t + 8 + j >= length || t + 8 + j < lo) e1[j] = 0.0f;
                }
            }
            *(v8 *)(s + t) = e0;
            *(v8 *)(s + t + 8) = e1;
            acc0 += e0;
            acc1 += e1;
        }
        float lanes[LANES];
        memcpy(lanes, &acc0, sizeof acc0);
        memcpy(lanes + 8, &acc1, sizeof acc1);
        inv_sum[r] = 1.0f / lane_sum(lanes);
    }
    /* out = sum_t p_t v_t / sum_t p_t, accumulated in `out` between pages */
    for (int64_t i = 0; i < kv_heads * group * hd; i++) out[i] = 0.0f;
    for (int64_t first = 0, pi = 0; first < length; first += ptok, pi++) {
        if (first + ptok <= lo) continue;
        const float *vp = base + pages[pi] * stride + v_off;
        const int64_t n = length - first < ptok ? length - first : ptok;
        /* the next V block's lines, shared out over this page's kv_heads x tokens */
        pf_cursor vcur = pf_page(base + v_off, pages, pi, length, ptok, stride, kvw, ahead);
        const int64_t vper = ((ptok * kvw + 15) / 16 + kv_heads * n - 1) / (kv_heads * n);
        for (int64_t h = 0; h < kv_heads; h++) {
            v8 ov[MAX_GROUP][MAX_CHUNKS];
            float *o = out + h * group * hd;
            for (int64_t g = 0; g < group; g++)
                for (int64_t c = 0; c < chunks; c++) ov[g][c] = *(v8 *)(o + g * hd + 8 * c);
            const float *sc = scores + h * group * stride_s + first;
            for (int64_t s = lo > first ? lo - first : 0; s < n; s++) {
                pf_some(&vcur, vper);
                const float *v = vp + s * kvw + h * hd;
                for (int64_t c = 0; c < chunks; c++) {
                    const v8 vc = *(const v8 *)(v + 8 * c);
                    for (int64_t g = 0; g < group; g++) ov[g][c] += sc[g * stride_s + s] * vc;
                }
            }
            for (int64_t g = 0; g < group; g++)
                for (int64_t c = 0; c < chunks; c++) *(v8 *)(o + g * hd + 8 * c) = ov[g][c];
        }
    }
    for (int64_t r = 0; r < kv_heads * group; r++)
        for (int64_t d = 0; d < hd; d++) out[r * hd + d] *= inv_sum[r];
}

static void attend_one(const job_t *job, int64_t seg, float *restrict scores) {
    const int64_t group = job->group, chunks = job->head_dim / 8;
#define SHAPE(G, C) if (group == G && chunks == C) { attend_body(job, seg, scores, G, C); return; }
#define SHAPES(C) SHAPE(1, C) SHAPE(2, C) SHAPE(3, C) SHAPE(4, C) SHAPE(5, C) SHAPE(6, C) \
    SHAPE(7, C) SHAPE(8, C)
    SHAPES(4) SHAPES(8) SHAPES(16)
#undef SHAPES
#undef SHAPE
    attend_body(job, seg, scores, group, chunks);
}

/* Returns 0 on success, -1 on bad arguments or no memory (nothing written then). */
int pd_decode_attention(int64_t n_seg, int64_t layer, int64_t kv_heads, int64_t group,
                        int64_t head_dim, const int64_t *bases, const int64_t *page_tokens,
                        const int64_t *page_stride, const int64_t *page_start,
                        const int64_t *pages, const int64_t *lengths, const float *q,
                        float *out, float scale, int64_t threads, int64_t window) {
    if (n_seg <= 0 || kv_heads <= 0 || group <= 0 || group > MAX_GROUP || head_dim <= 0
        || kv_heads * group > MAX_HEADS
        || head_dim % 8 != 0 || head_dim > 8 * MAX_CHUNKS || window < 0)
        return -1;
    int64_t max_length = 16;
    for (int64_t s = 0; s < n_seg; s++) {
        if (lengths[s] <= 0 || page_tokens[s] <= 0) return -1;
        if ((lengths[s] + page_tokens[s] - 1) / page_tokens[s]
            > page_start[s + 1] - page_start[s]) return -1;
        if ((lengths[s] + 15) / 16 * 16 > max_length) max_length = (lengths[s] + 15) / 16 * 16;
    }
    if (threads < 1) threads = 1;
    if (threads > n_seg) threads = n_seg;
    const int64_t per_thread = kv_heads * group * max_length;
    float *scratch = malloc(sizeof(float) * per_thread * threads);
    if (!scratch) return -1;
    job_t job = {n_seg, layer, kv_heads, group, head_dim, bases, page_tokens, page_stride,
                 page_start, pages, lengths, q, out, scale, window};
    /* Each request is computed by one thread start to end: its bits do not depend on the
     * thread count or the schedule. With OpenMP (torch's own runtime: the library is
     * loaded into a process that has it) the threads are torch's pool, not extra ones
     * competing with it for the cores. */
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t seg = 0; seg < n_seg; seg++) {
#ifdef _OPENMP
        float *mine = scratch + per_thread * omp_get_thread_num();
#else
        float *mine = scratch;
#endif
        attend_one(&job, seg, mine);
    }
    free(scratch);
    return 0;
}
