/* A decode step's element-wise work for pdmesh's CPU engine: RoPE with the K/V append, and SiLU(gate) * up. In torch each was a dozen
 * small calls per layer (slices, four multiplies, a concatenation, two index_put_, a SiLU,
 * a multiply): ~0.3 ms of a 3.5 ms tiny step at batch 16, for a few kB of arithmetic.
 *
 * Every value is computed from its own row only (its position, its features), so a row's
 * bits never depend on the batch (invariant I4).
 *
 * Built by services/engine/native.py with the machine's C compiler (-fopenmp); no libm.
 */
#include <stdint.h>
#include <string.h>

#include "vec_exp.h"

typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef int v16i __attribute__((vector_size(64)));

/* The same bits as the torch RoPE (model._rope, for the prefill): every product and
 * difference rounded on its own, as torch's element-wise ops do; the compiler may not fuse
 * them into FMAs here (the library is built with -ffp-contract=fast). */
__attribute__((optimize("fp-contract=off"))) static void
rope_row(const float *x, int64_t heads, int64_t half, const float *cos, const float *sin,
         float *out) {
    for (int64_t h = 0; h < heads; h++) {
        const float *x1 = x + 2 * h * half, *x2 = x1 + half;
        float *o1 = out + 2 * h * half, *o2 = o1 + half;
        for (int64_t i = 0; i < half; i++) {
            const float a = x1[i], b = x2[i], c = cos[i], s = sin[i];
            o1[i] = a * c - b * s;
            o2[i] = b * c + a * s;
        }
    }
}

/* RoPE of a decode step's q and k, and the append of k and v to the KV storage.
 *
 * qkv [m][(heads + 2 * kv_heads) * head_dim]: each row's q heads, k heads, v heads (the
 * fused qkv matmul's output). positions [m]: each row's position, < table_rows.
 * cos, sin [table_rows][head_dim / 2]: the model's tables. q_out [m][heads * head_dim]:
 * the rotated queries. k_dst, v_dst [m]: byte addresses where each row's rotated k and its
 * v (kv_heads * head_dim floats each) are stored, computed and checked by the caller from
 * the request's own pages (native.py).
 * Returns 0, or 1 for arguments it does not take (nothing written then). */
int pd_decode_rope_kv(const float *qkv, int64_t m, int64_t heads, int64_t kv_heads,
                      int64_t head_dim, const int64_t *positions, const float *cos,
                      const float *sin, int64_t table_rows, float *q_out,
                      const int64_t *k_dst, const int64_t *v_dst) {
    if (m < 0 || heads < 1 || kv_heads < 1 || head_dim < 2 || head_dim % 2) return 1;
    for (int64_t r = 0; r < m; r++)
        if (positions[r] < 0 || positions[r] >= table_rows || !k_dst[r] || !v_dst[r])
            return 1;
    const int64_t half = head_dim / 2, kvw = kv_heads * head_dim;
    const int64_t width = (heads + 2 * kv_heads) * head_dim;
    for (int64_t r = 0; r < m; r++) {
        const float *row = qkv + r * width;
        const float *c = cos + positions[r] * half, *s = sin + positions[r] * half;
        rope_row(row, heads, half, c, s, q_out + r * heads * head_dim);
        rope_row(row + heads * head_dim, kv_heads, half, c, s,
                 (float *)(intptr_t)k_dst[r]);
        memcpy((float *)(intptr_t)v_dst[r], row + heads * head_dim + kvw,
               sizeof(float) * (size_t)kvw);
    }
    return 0;
}

/* vmax16 and exp16: exp(x) for x <= 0, 16 lanes at a time */
PD_VEC_EXP(v16, v16i, vmax16, exp16)

/* out[r][i] = silu(g) * u = g / (1 + exp(-g)) * u, with g = gate_up[r][i] and u =
 * gate_up[r][ffn + i] (the fused gate/up matmul's output [m][2 * ffn]); out [m][ffn].
 * exp only ever of -|g| (no overflow): for g < 0, silu(g) = g * e / (1 + e), e = exp(g)
 * (0 for g < -87: silu rounds to -0 there, as in torch).
 * Returns 0, or 1 for arguments it does not take (ffn not a positive multiple of 16). */
int pd_decode_silu_mul(const float *gate_up, int64_t m, int64_t ffn, float *out) {
    if (m < 0 || ffn < 16 || ffn % 16) return 1;
    const v16i sign = (v16i){0} + INT32_MIN;
    for (int64_t r = 0; r < m; r++) {
        const float *g = gate_up + r * 2 * ffn, *u = g + ffn;
        float *o = out + r * ffn;
        for (int64_t i = 0; i < ffn; i += 16) {
            const v16 x = *(const v16 *)(g + i);
            const v16i negative = x < 0;
            const v16 down = (v16)((v16i)x | sign);  /* -|x| */
            /* exp(-|x|), 0 below -87 (e^-87 ~ 1.6e-38: the result rounds to a zero) */
            const v16 e = (v16)((v16i)exp16(down) & (down >= -87.0f));
            const v16 top = (v16)(((v16i)(x * e) & negative) | ((v16i)x & ~negative));
            *(v16 *)(o + i) = top / (1.0f + e) * *(const v16 *)(u + i);
        }
    }
    return 0;
}
