/* Decode matmuls on a GGUF's own quantized blocks (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K), for pdmesh's
 * CPU engine.
 *
 * out[r][j] ~= sum_k x[r][k] * w[j][k] for the m rows of one decode step, where w's rows
 * are kept as GGUF stores them (blocks of 32 weights: an fp16 scale d, for Q4_1 an fp16
 * offset m, and 32 4-bit or 8-bit integers) and each row of x is first quantized the way
 * llama.cpp quantizes activations (per block of 32: scale amax / 127, int8 values rounded
 * to nearest). A block's dot product is then an integer sum (exact), scaled in float:
 *
 *   Q8_0: d_w * d_x * sum(q_w * q_x)
 *   Q4_1: d_w * d_x * sum(q_w * q_x) + m_w * d_x * sum(q_x)
 *   Q4_0: as Q4_1 with m_w = -8 d_w (its values are d_w * (q_w - 8))
 *   Q4_K: per sub-block of 32 of a 256-value super-block, as Q4_1 with d_w = d * scale and
 *         m_w = -dmin * min (6-bit scale and min, packed; its values are d_w q_w + m_w)
 *   Q6_K: per sub-block of 32 of a 256-value super-block, d * d_x * sum over its two halves
 *         of 16 of scale_h * sum((q_w - 32) * q_x) (6-bit q_w, 8-bit signed scales): the
 *         scales multiply the integer lane sums, which stay exact
 *
 * The weights stream from memory at 4.5 to 8.5 bits each instead of 32, which is what a
 * decode step is bound by.
 *
 * Batch invariance (invariant I4), as decode_linear.c: a row of x is quantized from that
 * row alone, and every output is one fixed sequence of operations that depends on nothing
 * but k: the integer sums of each block in 8 lanes (lane l: values 4l .. 4l + 3, exact),
 * per block one fused multiply-add of each lane's sum into 8 float lanes and one of the
 * offset term into a ninth, the even blocks into one such set and the odd ones into
 * another (two independent chains, so a row is not bound by the multiply-add's latency),
 * then the two sets added lane by lane and one fixed tree over the 8 lanes plus the two
 * offsets. The row
 * count, the row's place, the thread and the instruction set change only the schedule:
 * the AVX2 path (VNNI's `dpbusd` for the lane sums where the CPU has it) and the portable
 * one give the same bits (`pd_decode_linear_q_portable`, for the tests).
 *
 * Built by services/engine/native.py with decode_linear.c (-fopenmp).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define QK 32 /* values per block of x, and per (sub-)block of every weight format here */
#define QK_K 256 /* values per Q4_K super-block: 8 sub-blocks */
enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q6_K = 14 }; /* GGML's type numbers */

typedef struct { /* one block of a quantized activation row */
    float d;     /* scale */
    float ds;    /* d * sum(q): the offset term's factor */
    int8_t q[QK];
} xblock;

static inline float fp16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man) { /* subnormal: normalise */
        int e = -1;
        uint32_t mm = man;
        do { e++; mm <<= 1; } while (!(mm & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((mm & 0x3ff) << 13);
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* Bytes of one row of `k` values of `type` (0: a type or k this file does not take). */
int64_t pd_quant_row_bytes(int64_t type, int64_t k) {
    if (k < QK || k % QK) return 0;
    switch (type) {
    case Q4_0: return k / QK * 18;
    case Q4_1: return k / QK * 20;
    case Q8_0: return k / QK * 34;
    case Q4_K: return k % QK_K ? 0 : k / QK_K * 144;
    case Q6_K: return k % QK_K ? 0 : k / QK_K * 210;
    default: return 0;
    }
}

/* The activation row, block by block: scale amax / 127, values rounded to nearest even. */
static void quantize_row(const float *x, int64_t k, xblock *out) {
    for (int64_t b = 0; b < k / QK; b++) {
        const float *v = x + b * QK;
        float amax = 0.0f;
        for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(v[i]));
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        int32_t s = 0;
        for (int i = 0; i < QK; i++) {
            const int32_t q = (int32_t)nearbyintf(v[i] * id);
            out[b].q[i] = (int8_t)q;
            s += q;
        }
        out[b].d = d;
        out[b].ds = d * (float)s;
    }
}

/* Q6_K block b of a weight row: where its 32 bytes of high 2-bit pairs start (bits 2 (b % 4)
 * and up of each), and the signed scale of its half h (0: values 0-15, 1: 16-31). */
static inline const uint8_t *q6k_high(const uint8_t *row, int64_t b) {
    return row + b / 8 * 210 + 128 + 32 * ((b % 8) / 4);
}

static inline int32_t q6k_scale(const uint8_t *row, int64_t b, int h) {
    return (int8_t)row[b / 8 * 210 + 192 + 2 * (b % 8) + h];
}

/* Block b (of 32 values) of a weight row: its scale d_w and offset m_w, where its
 * integers start, and for Q4_K which nibble of them holds it (shift 0 or 4). */
static inline const uint8_t *block_head(const uint8_t *row, int64_t type, int64_t b, float *d,
                                        float *m, int *shift) {
    *shift = 0;
    if (type == Q6_K) { /* 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 scales, d */
        const uint8_t *sb = row + b / 8 * 210;
        const int j = (int)(b % 8);
        *d = fp16(sb + 208);
        *m = 0.0f;
        *shift = 4 * ((j % 4) / 2); /* sub-blocks 2, 3 of each half: the high nibbles */
        return sb + 64 * (j / 4) + 32 * (j % 2);
    }
    if (type == Q4_K) { /* d, dmin, 12 bytes of 6-bit scales and mins, 128 of nibbles */
        const uint8_t *sb = row + b / 8 * 144, *sc = sb + 4;
        const int j = (int)(b % 8);
        int scale, min;
        if (j < 4) {
            scale = sc[j] & 63;
            min = sc[j + 4] & 63;
        } else {
            scale = (sc[j + 4] & 0x0f) | ((sc[j - 4] >> 6) << 4);
            min = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
        }
        *d = fp16(sb) * (float)scale;
        *m = -(fp16(sb + 2) * (float)min);
        *shift = 4 * (j % 2); /* sub-blocks 2i and 2i + 1 share 32 bytes: low, high nibbles */
        return sb + 16 + 32 * (j / 2);
    }
    const uint8_t *blk = row + b * (type == Q4_0 ? 18 : type == Q4_1 ? 20 : 34);
    *d = fp16(blk);
    if (type == Q4_1) {
        *m = fp16(blk + 2);
        return blk + 4;
    }
    *m = type == Q4_0 ? -8.0f * *d : 0.0f;
    return blk + 2;
}

/* The fixed tree over the 8 lanes of the even blocks' and of the odd blocks' sums, then
 * the offset terms (even, odd). */
static inline float finish(const float even[8], const float odd[8], float off_even,
                           float off_odd) {
    float acc[8];
    for (int l = 0; l < 8; l++) acc[l] = even[l] + odd[l];
    return (((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7])))
           + (off_even + off_odd);
}

/* One output, portable: the lane sums in C. */
static float dot_portable(const uint8_t *w, int64_t type, const xblock *x, int64_t blocks) {
    float acc[2][8] = {{0}}, off[2] = {0.0f, 0.0f};
    for (int64_t b = 0; b < blocks; b++) {
        const int p = (int)(b & 1);
        float d, m;
        int shift;
        const uint8_t *q = block_head(w, type, b, &d, &m, &shift);
        int32_t wv[QK];
        if (type == Q8_0) {
            for (int i = 0; i < QK; i++) wv[i] = (int8_t)q[i];
        } else if (type == Q6_K) {
            const uint8_t *qh = q6k_high(w, b);
            const int hshift = 2 * (int)(b % 4);
            for (int i = 0; i < QK; i++)
                wv[i] = (((q[i] >> shift) & 0x0f) | (((qh[i] >> hshift) & 3) << 4)) - 32;
        } else if (type == Q4_K) {
            for (int i = 0; i < QK; i++) wv[i] = (q[i] >> shift) & 0x0f;
        } else { /* low nibbles are values 0..15, high ones 16..31 */
            for (int i = 0; i < QK / 2; i++) {
                wv[i] = q[i] & 0x0f;
                wv[i + QK / 2] = q[i] >> 4;
            }
        }
        const float dd = d * x[b].d;
        for (int l = 0; l < 8; l++) {
            int32_t s = 0;
            for (int i = 4 * l; i < 4 * l + 4; i++) s += wv[i] * x[b].q[i];
            if (type == Q6_K) s *= q6k_scale(w, b, l / 4);
            acc[p][l] = fmaf(dd, (float)s, acc[p][l]);
        }
        if (type != Q8_0 && type != Q6_K) off[p] = fmaf(m, x[b].ds, off[p]);
    }
    return finish(acc[0], acc[1], off[0], off[1]);
}

#ifdef __AVX2__
/* Block b of row r of the quantized x (`blocks` a row). */
static inline const xblock *x_block(const xblock *x, int64_t blocks, int r, int64_t b) {
    return x + r * blocks + b;  /* guard: native-linear-q-rows */
}

/* Per 32-bit lane, the sum of its 4 products of unsigned bytes a by signed bytes b: one
 * VNNI instruction where the CPU has one, else AVX2's multiply-add of bytes into 16-bit pair
 * sums, then of pairs. The same integers either way: a pair sum never saturates here (a is a
 * 4-bit value, or a Q8_0 weight's magnitude <= 128; b an int8 of x within +-127). */
static inline __m256i dot_u8s8(__m256i a, __m256i b) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), a, b);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
#endif
}

/* Block b of weight row w against `rows` rows of x, into accumulators acc / off (AVX2):
 * the block's integers unpacked once, then for each row of x the same lanes as the portable
 * path (`dot_u8s8`; Q6_K: bytes into 16-bit pairs, then pairs times the halves' scales). With
 * `type` a constant the compiler drops every other type's code. */
static inline __attribute__((always_inline)) void
block_avx2(const uint8_t *w, const int type, const xblock *x, int64_t blocks, int64_t b,
           const int rows, const float *kd, const float *km, __m256 *acc, float *off) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    float d, m;
    const uint8_t *q;
    __m256i wq;
    if (type == Q6_K) { /* u = low nibble | high pair << 4; dot = sum((u - 32) x) per half,
                           times the half's scale, in 16-bit pairs then 32-bit lanes */
        int shift;
        q = block_head(w, type, b, &d, &m, &shift);
        const __m256i lo = _mm256_and_si256(
            _mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)q), shift), low);
        const __m256i hi = _mm256_and_si256(
            _mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)q6k_high(w, b)),
                              2 * (int)(b % 4)), _mm256_set1_epi8(3));
        const __m256i u = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
        const __m256i scales = _mm256_set_m128i(_mm_set1_epi16((int16_t)q6k_scale(w, b, 1)),
                                                _mm_set1_epi16((int16_t)q6k_scale(w, b, 0)));
        const __m256i c32 = _mm256_set1_epi8(32);
        for (int r = 0; r < rows; r++) {
            const xblock *xb = x_block(x, blocks, r, b);
            const __m256i xq = _mm256_loadu_si256((const __m256i *)xb->q);
            const __m256i pairs = _mm256_sub_epi16(_mm256_maddubs_epi16(u, xq),
                                                   _mm256_maddubs_epi16(c32, xq));
            const __m256 s = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, scales));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * xb->d), s, acc[r]);
        }
        return;
    }
    if (type == Q4_K) { /* scales and mins of the super-block, unpacked by the caller */
        q = w + b / 8 * 144 + 16 + 32 * ((b % 8) / 2);
        d = kd[b % 8];
        m = km[b % 8];
        const __m256i raw = _mm256_loadu_si256((const __m256i *)q);
        wq = _mm256_and_si256((b & 1) ? _mm256_srli_epi16(raw, 4) : raw, low);
    } else if (type == Q4_1) { /* d and m: one conversion of both halves */
        q = w + b * 20;
        uint32_t dm;
        memcpy(&dm, q, 4);
        const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dm));
        d = _mm_cvtss_f32(f);
        m = _mm_cvtss_f32(_mm_movehdup_ps(f));
        const __m128i raw = _mm_loadu_si128((const __m128i *)(q + 4));
        wq = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low);
    } else {
        int shift;
        q = block_head(w, type, b, &d, &m, &shift);
        if (type == Q8_0) {
            wq = _mm256_loadu_si256((const __m256i *)q);
        } else {
            const __m128i raw = _mm_loadu_si128((const __m128i *)q);
            wq = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low);
        }
    }
    const __m256i wabs = type == Q8_0 ? _mm256_sign_epi8(wq, wq) : wq;
    for (int r = 0; r < rows; r++) {
        const xblock *xb = x_block(x, blocks, r, b);
        __m256i xq = _mm256_loadu_si256((const __m256i *)xb->q);
        if (type == Q8_0) xq = _mm256_sign_epi8(xq, wq);
        const __m256 s = _mm256_cvtepi32_ps(dot_u8s8(wabs, xq));
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * xb->d), s, acc[r]);
        if (type != Q8_0) off[r] = fmaf(m, xb->ds, off[r]);
    }
}

/* The 8 scales and mins of Q4_K super-block `sb`, as block_head computes them. */
static inline void q4k_scales(const uint8_t *sb, float *kd, float *km) {
    const uint8_t *sc = sb + 4;
    const float d = fp16(sb), dmin = fp16(sb + 2);
    for (int j = 0; j < 8; j++) {
        int scale, min;
        if (j < 4) {
            scale = sc[j] & 63;
            min = sc[j + 4] & 63;
        } else {
            scale = (sc[j + 4] & 0x0f) | ((sc[j - 4] >> 6) << 4);
            min = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
        }
        kd[j] = d * (float)scale;
        km[j] = -(dmin * (float)min);
    }
}

/* `rows` outputs of one weight row: even blocks into one set of accumulators, odd ones
 * into another (two independent chains of multiply-adds, the portable path's order). */
static inline __attribute__((always_inline)) void
dot_avx2(const uint8_t *w, const int type, const xblock *x, int64_t blocks, const int rows,
         float *res) {
    __m256 even[4], odd[4];
    float off_even[4], off_odd[4], kd[8], km[8];
    for (int r = 0; r < rows; r++) {
        even[r] = odd[r] = _mm256_setzero_ps();
        off_even[r] = off_odd[r] = 0.0f;
    }
    int64_t b = 0;
    for (; b + 2 <= blocks; b += 2) {
        if (type == Q4_K && b % 8 == 0) q4k_scales(w + b / 8 * 144, kd, km);
        block_avx2(w, type, x, blocks, b, rows, kd, km, even, off_even);
        block_avx2(w, type, x, blocks, b + 1, rows, kd, km, odd, off_odd);
    }
    if (b < blocks) block_avx2(w, type, x, blocks, b, rows, kd, km, even, off_even);
    for (int r = 0; r < rows; r++) { /* finish()'s tree, in vector halves */
        const __m256 acc = _mm256_add_ps(even[r], odd[r]);
        const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
        res[r] = _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q))) + (off_even[r] + off_odd[r]);
    }
}

/* Every row of x against weight row j, four rows of x at a time. */
static inline __attribute__((always_inline)) void
rows_avx2(const uint8_t *w, const int type, const xblock *x, int64_t blocks, int64_t m,
          int64_t n, int64_t j, float *out) {
    float res[4];
    int64_t r = 0;
    for (; r + 4 <= m; r += 4) {
        dot_avx2(w, type, x + r * blocks, blocks, 4, res);
        for (int i = 0; i < 4; i++) out[(r + i) * n + j] = res[i];
    }
    for (; r < m; r++) {
        dot_avx2(w, type, x + r * blocks, blocks, 1, res);
        out[r * n + j] = res[0];
    }
}

static void row_avx2(const uint8_t *w, int64_t type, const xblock *x, int64_t blocks,
                     int64_t m, int64_t n, int64_t j, float *out) {
    switch (type) { /* one copy of the loop per type */
    case Q4_0: rows_avx2(w, Q4_0, x, blocks, m, n, j, out); break;
    case Q4_1: rows_avx2(w, Q4_1, x, blocks, m, n, j, out); break;
    case Q8_0: rows_avx2(w, Q8_0, x, blocks, m, n, j, out); break;
    case Q4_K: rows_avx2(w, Q4_K, x, blocks, m, n, j, out); break;
    default: rows_avx2(w, Q6_K, x, blocks, m, n, j, out); break;
    }
}
#endif

static void row_portable(const uint8_t *w, int64_t type, const xblock *x, int64_t blocks,
                         int64_t m, int64_t n, int64_t j, float *out) {
    for (int64_t r = 0; r < m; r++) out[r * n + j] = dot_portable(w, type, x + r * blocks, blocks);
}

typedef void (*row_fn)(const uint8_t *, int64_t, const xblock *, int64_t, int64_t, int64_t,
                       int64_t, float *);

static int linear_q(const float *x, int64_t m, int64_t k, const uint8_t *w, int64_t type,
                    int64_t n, float *out, int64_t threads, row_fn row) {
    const int64_t row_bytes = pd_quant_row_bytes(type, k), blocks = k / QK;
    if (m < 1 || n < 1 || threads < 1 || !row_bytes) return 1;
    xblock *xq = malloc((size_t)(m * blocks) * sizeof(xblock));
    if (!xq) return 2;
    for (int64_t r = 0; r < m; r++) quantize_row(x + r * k, k, xq + r * blocks);
    /* each weight row read once per step, for every row of x while it is in cache */
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t j = 0; j < n; j++) row(w + j * row_bytes, type, xq, blocks, m, n, j, out);
    free(xq);
    return 0;
}

/* Returns 0, or 1 for arguments it does not take (k not a positive multiple of 32, or of
 * 256 for Q4_K and Q6_K; a type other than Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K; no rows), 2
 * when out of memory. */
int pd_decode_linear_q(const float *x, int64_t m, int64_t k, const uint8_t *w, int64_t type,
                       int64_t n, float *out, int64_t threads) {
#ifdef __AVX2__
    return linear_q(x, m, k, w, type, n, out, threads, row_avx2);
#else
    return linear_q(x, m, k, w, type, n, out, threads, row_portable);
#endif
}

/* The same in portable C whatever the CPU (the tests hold the two to the same bits). */
int pd_decode_linear_q_portable(const float *x, int64_t m, int64_t k, const uint8_t *w,
                                int64_t type, int64_t n, float *out, int64_t threads) {
    return linear_q(x, m, k, w, type, n, out, threads, row_portable);
}
