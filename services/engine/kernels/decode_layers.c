/* Every layer of a decode step in one call.
 *
 * The same kernels, in the same order, on the same values as the per-layer calls from
 * Python (RMSNorm with the residual add, the fused qkv matmul, RoPE and the K/V append,
 * the paged attention, the o matmul, RMSNorm, gate/up, SiLU * up, down; then the final
 * RMSNorm), so the same bits:
 * what changes is that Python no longer runs between them (a tiny step made ~40 calls
 * through ctypes, each with its checks and a fresh output tensor: ~0.2 ms of a 0.8 ms
 * batch-1 step).
 *
 * Arguments, all validated by the caller (services/engine/native.py, `DecodeLayers`):
 *   step[]: the step's geometry and buffers, see enum below;
 *   weights[layer * 11 + i]: addresses of attn_norm, wqkv, wo, ffn_norm, w_gate_up, w_down,
 *   the q/k/v bias added after the qkv matmul (0: none), then the GGML type of wqkv, wo,
 *   w_gate_up and w_down: 0 for fp32 rows (decode_linear.c), else that type's quantized
 *   blocks (decode_linear_q.c).
 * Returns 0, or (stage << 8) | the failing kernel's status: 1 attn norm, 2 qkv, 3 rope/kv,
 * 4 attention, 5 o, 6 ffn norm, 7 gate/up, 8 silu, 9 down, 10 the final norm; nothing
 * after a failure runs.
 */
#include <stdint.h>

int pd_decode_attention(int64_t n_seg, int64_t layer, int64_t kv_heads, int64_t group,
                        int64_t head_dim, const int64_t *bases, const int64_t *page_tokens,
                        const int64_t *page_stride, const int64_t *page_start,
                        const int64_t *pages, const int64_t *lengths, const float *q,
                        float *out, float scale, int64_t threads, int64_t window);
int pd_decode_linear(const float *x, int64_t m, int64_t k, const float *w, int64_t n,
                     float *out, int64_t threads);
int pd_decode_linear_q(const float *x, int64_t m, int64_t k, const uint8_t *w, int64_t type,
                       int64_t n, float *out, int64_t threads);
int pd_decode_rms_norm(float *x, const float *delta, int64_t m, int64_t dim,
                       const float *w, float eps, float *out);
int pd_decode_rope_kv(const float *qkv, int64_t m, int64_t heads, int64_t kv_heads,
                      int64_t head_dim, const int64_t *positions, const float *cos,
                      const float *sin, int64_t table_rows, float *q_out,
                      const int64_t *k_dst, const int64_t *v_dst);
int pd_decode_silu_mul(const float *gate_up, int64_t m, int64_t ffn, float *out);

enum {
    S_M, S_DIM, S_HEADS, S_KV_HEADS, S_HEAD_DIM, S_FFN, S_LAYERS, S_THREADS,
    S_X,        /* [m][dim] the residual stream, updated in place */
    S_DELTA,    /* [m][dim] the residual branch not yet added to x (scratch) */
    S_H, S_QKV, S_Q, S_ATTN, S_GATE_UP, S_ACT, /* scratch */
    S_POSITIONS, S_COS, S_SIN, S_TABLE_ROWS,
    S_TARGETS,  /* [layers][2][m] byte addresses of each row's K and V slot */
    S_BASES, S_PAGE_TOKENS, S_PAGE_STRIDE, S_PAGE_START, S_PAGES, S_LENGTHS, /* attention */
    S_NORM,     /* [dim] the final norm's weight */
    S_HIDDEN,   /* [m][dim] out: the final norm of the residual stream */
    S_WINDOW,   /* the sliding window in keys (0: none) */
    S_COUNT
};

/* How many fields the step array has (native.py checks it against its own list). */
int64_t pd_decode_layers_fields(void) { return S_COUNT; }

#define PTR(T, i) ((T)(intptr_t)step[i])
#define LAYER_SLOTS 11

/* One of the layer's matmuls: on fp32 rows, or on quantized blocks of GGML type `type`. */
static int linear(const float *x, int64_t m, int64_t k, int64_t w, int64_t type, int64_t n,
                  float *out, int64_t threads) {
    if (type)
        return pd_decode_linear_q(x, m, k, (const uint8_t *)(intptr_t)w, type, n, out, threads);
    return pd_decode_linear(x, m, k, (const float *)(intptr_t)w, n, out, threads);
}

int pd_decode_layers(const int64_t *step, const int64_t *weights, float eps, float scale) {
    const int64_t m = step[S_M], dim = step[S_DIM], heads = step[S_HEADS];
    const int64_t kv_heads = step[S_KV_HEADS], hd = step[S_HEAD_DIM], ffn = step[S_FFN];
    const int64_t layers = step[S_LAYERS], threads = step[S_THREADS];
    const int64_t q_dim = heads * hd, qkv_dim = (heads + 2 * kv_heads) * hd;
    float *x = PTR(float *, S_X), *delta = PTR(float *, S_DELTA), *h = PTR(float *, S_H);
    float *qkv = PTR(float *, S_QKV), *q = PTR(float *, S_Q), *attn = PTR(float *, S_ATTN);
    float *gate_up = PTR(float *, S_GATE_UP), *act = PTR(float *, S_ACT);
    const int64_t *targets = PTR(const int64_t *, S_TARGETS);
    if (m < 1 || layers < 1 || kv_heads < 1 || heads % kv_heads) return 1;
    int status;
#define RUN(stage, call) if ((status = (call)) != 0) return ((stage) << 8) | (status & 0xff)
    for (int64_t layer = 0; layer < layers; layer++) {
        const int64_t *slot = weights + LAYER_SLOTS * layer, *type = slot + 7;
        const float *const *w = (const float *const *)slot;
        RUN(1, pd_decode_rms_norm(x, layer == 0 ? 0 : delta, m, dim, w[0], eps, h));
        RUN(2, linear(h, m, dim, slot[1], type[0], qkv_dim, qkv, threads));
        if (w[6])  /* one add per value, as torch's qkv + bias */
            for (int64_t r = 0; r < m; r++)
                for (int64_t j = 0; j < qkv_dim; j++) qkv[r * qkv_dim + j] += w[6][j];  /* guard: qkv-bias-native */
        RUN(3, pd_decode_rope_kv(qkv, m, heads, kv_heads, hd, PTR(const int64_t *, S_POSITIONS),
                                 PTR(const float *, S_COS), PTR(const float *, S_SIN),
                                 step[S_TABLE_ROWS], q, targets + layer * 2 * m,
                                 targets + layer * 2 * m + m));
        RUN(4, pd_decode_attention(m, layer, kv_heads, heads / kv_heads, hd,
                                   PTR(const int64_t *, S_BASES),
                                   PTR(const int64_t *, S_PAGE_TOKENS),
                                   PTR(const int64_t *, S_PAGE_STRIDE),
                                   PTR(const int64_t *, S_PAGE_START),
                                   PTR(const int64_t *, S_PAGES),
                                   PTR(const int64_t *, S_LENGTHS), q, attn, scale,
                                   threads < 16 ? threads : 16, step[S_WINDOW]));
        RUN(5, linear(attn, m, q_dim, slot[2], type[1], dim, delta, threads));
        RUN(6, pd_decode_rms_norm(x, delta, m, dim, w[3], eps, h));
        RUN(7, linear(h, m, dim, slot[4], type[2], 2 * ffn, gate_up, threads));
        RUN(8, pd_decode_silu_mul(gate_up, m, ffn, act));
        RUN(9, linear(act, m, ffn, slot[5], type[3], dim, delta, threads));
    }
    RUN(10, pd_decode_rms_norm(x, delta, m, dim, PTR(const float *, S_NORM), eps,
                               PTR(float *, S_HIDDEN)));
#undef RUN
    return 0;
}
