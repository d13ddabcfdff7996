/* Decode matmuls for pdmesh's CPU engine.
 *
 * out[r][j] = sum_k x[r][k] * w[j][k] for the m rows of one decode step (x [m][k], w
 * [n][k], out [m][n], all row-major and contiguous, fp32).
 *
 * Every output is computed by one fixed sequence of operations that depends on nothing
 * but k: 16 running lanes (lane l sums k = l, l + 16, ... in order, one fused
 * multiply-add each) and then one fixed tree over the 16 lanes. The row count, the row's
 * place among them, which thread computes it and how w's rows are grouped change only the
 * schedule, never that sequence, so a row's bits are the same alone or in any batch: no
 * decode step needs padding rows for batch invariance (invariant I4), and the paged engine
 * and the reference engine, both running it, agree bit for bit.
 *
 * Schedule: a tile is 16 outputs held in registers, 16 rows of w by 1 row of x when the
 * step has one row, else 8 rows of w by 2 rows of x (a step with an odd row count gets a
 * zero row, whose results are dropped); w's rows are split over the threads. w is
 * streamed from memory once per step whatever m is, which is where BLAS's 1..4-row
 * kernels lose time (see ../README.md). The tile shape changes which outputs are computed
 * together, never the operations computing one (checked: every shape gives the same bits).
 *
 * Built by services/engine/native.py with the machine's C compiler (-fopenmp).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE 16 /* outputs per tile: rows of w times rows of x */
#define LANES 16

/* 16 floats, loaded unaligned: one AVX-512 register, two AVX ones, four SSE/NEON ones */
typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef int v16i __attribute__((vector_size(64)));

/* Lane i of the result is the sum of the 16 lanes of a[i], for every i in the same tree
 * (((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7))) + (((l8+l9)+...)): pairs, then pairs of pairs,
 * each step one shuffle-add over two vectors. */
static inline v16 transpose_sums(const v16 *a) {
    const v16i e1 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
    const v16i o1 = {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
    const v16i e2 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
    const v16i o2 = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
    const v16i e3 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
    const v16i o3 = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
    const v16i e4 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const v16i o4 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    v16 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++)
        b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], e1)
               + __builtin_shuffle(a[2 * i], a[2 * i + 1], o1);
    for (int i = 0; i < 4; i++)
        c[i] = __builtin_shuffle(b[2 * i], b[2 * i + 1], e2)
               + __builtin_shuffle(b[2 * i], b[2 * i + 1], o2);
    for (int i = 0; i < 2; i++)
        d[i] = __builtin_shuffle(c[2 * i], c[2 * i + 1], e3)
               + __builtin_shuffle(c[2 * i], c[2 * i + 1], o3);
    return __builtin_shuffle(d[0], d[1], e4) + __builtin_shuffle(d[0], d[1], o4);
}

/* One tile: lane a * x_rows + b of the result is w[a] . x[b] over k floats. Inlined with
 * constant shapes, so the accumulators live in registers. */
static inline __attribute__((always_inline)) v16
tile(const float *restrict w, const float *restrict x, int64_t k, const int w_rows,
     const int x_rows) {
    v16 acc[TILE];
#pragma GCC unroll 16
    for (int i = 0; i < TILE; i++) acc[i] = (v16){0};
    for (int64_t kk = 0; kk < k; kk += LANES) {
        v16 wv[TILE], xv[TILE];
#pragma GCC unroll 16
        for (int a = 0; a < w_rows; a++) wv[a] = *(const v16 *)(w + a * k + kk);
#pragma GCC unroll 16
        for (int b = 0; b < x_rows; b++) xv[b] = *(const v16 *)(x + b * k + kk);
#pragma GCC unroll 16
        for (int a = 0; a < w_rows; a++)
#pragma GCC unroll 16
            for (int b = 0; b < x_rows; b++) acc[a * x_rows + b] += wv[a] * xv[b];
    }
    return transpose_sums(acc);
}

/* The outputs of weight rows j0 .. j0 + w_rows (the last block ends at row n: it may
 * recompute rows of the one before, same operations, same bits) for every row of x. */
static inline __attribute__((always_inline)) void
block(const float *x, int64_t m, int64_t k, const float *w, int64_t n, float *out,
      int64_t blk, const int w_rows, const int x_rows) {
    const int64_t j0 = blk * w_rows + w_rows > n ? n - w_rows : blk * w_rows;
    for (int64_t g = 0; g < (m + x_rows - 1) / x_rows; g++) {
        float sums[TILE];
        *(v16 *)sums = tile(w + j0 * k, x + g * x_rows * k, k, w_rows, x_rows);
        for (int64_t b = 0; b < x_rows && g * x_rows + b < m; b++)
            for (int64_t a = 0; a < w_rows; a++)
                out[(g * x_rows + b) * n + j0 + a] = sums[a * x_rows + b];  /* guard: native-linear-rows */
    }
}

/* One function per tile shape, so that the shape is a constant where the tile is
 * compiled (inside an OpenMP region it would not be, and the accumulators would live on
 * the stack). */
static void block_16x1(const float *x, int64_t m, int64_t k, const float *w, int64_t n,
                       float *out, int64_t blk) {
    block(x, m, k, w, n, out, blk, 16, 1);
}

static void block_8x2(const float *x, int64_t m, int64_t k, const float *w, int64_t n,
                      float *out, int64_t blk) {
    block(x, m, k, w, n, out, blk, 8, 2);
}

/* Returns 0, or 1 for arguments it does not take (k not a positive multiple of 16, fewer
 * than 16 rows of w, no rows of x), 2 when out of memory. */
int pd_decode_linear(const float *x, int64_t m, int64_t k, const float *w, int64_t n,
                     float *out, int64_t threads) {
    if (m < 1 || k < LANES || k % LANES || n < TILE || threads < 1) return 1;
    const int one_row = m == 1;
    float *padded = NULL;
    if (!one_row && m % 2) { /* a zero row up to a whole tile: computed, never stored */
        padded = calloc((size_t)((m + 1) * k), sizeof(float));
        if (!padded) return 2;
        memcpy(padded, x, (size_t)(m * k) * sizeof(float));
        x = padded;
    }
    const int64_t blocks = one_row ? (n + 15) / 16 : (n + 7) / 8;
    /* OpenMP in the pool torch loaded (see decode_attention.c); each output is computed
     * by one thread, so the thread count changes no bits. */
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t blk = 0; blk < blocks; blk++) {
        if (one_row)
            block_16x1(x, m, k, w, n, out, blk);
        else
            block_8x2(x, m, k, w, n, out, blk);
    }
    free(padded);
    return 0;
}

/* RMSNorm of a decode step's rows, out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, with the
 * residual add before it fused in when `delta` is given (x[r] += delta[r] first, in
 * place). Each row in one fixed order (16 lanes of squares, the tree above, one
 * division), whatever the other rows. Rows are short (the model's dim): one thread. */
int pd_decode_rms_norm(float *x, const float *delta, int64_t m, int64_t dim,
                       const float *w, float eps, float *out) {
    if (m < 0 || dim < LANES || dim % LANES) return 1;
    for (int64_t r = 0; r < m; r++) {
        float *row = x + r * dim;
        if (delta)
            for (int64_t i = 0; i < dim; i += LANES)
                *(v16 *)(row + i) = *(const v16 *)(row + i) + *(const v16 *)(delta + r * dim + i);
        v16 acc[LANES] = {{0}};
        for (int64_t i = 0; i < dim; i += LANES) {
            const v16 v = *(const v16 *)(row + i);
            acc[0] += v * v;
        }
        const float scale = 1.0f / __builtin_sqrtf(transpose_sums(acc)[0] / (float)dim + eps);
        for (int64_t i = 0; i < dim; i += LANES)
            *(v16 *)(out + r * dim + i) = *(const v16 *)(row + i) * scale
                                          * *(const v16 *)(w + i);
    }
    return 0;
}
