/* exp(x) for x <= 0 on a GCC float vector type, no library call: Cephes' expf polynomial
 * after reducing by ln 2, arguments below -87 taken as -87. Shared by decode_attention.c
 * (8 lanes: the softmax) and decode_pointwise.c (16 lanes: SiLU).
 *
 * PD_VEC_EXP(V, VI, vmax, exp) defines `vmax(a, b)` (lane-wise max) and `exp(x)` for the
 * float vector type V whose int twin is VI. (native.py hashes this header with the
 * sources: the cached library is rebuilt when it changes.) */
#ifndef PDMESH_VEC_EXP_H
#define PDMESH_VEC_EXP_H

#define PD_VEC_EXP(V, VI, vmax, exp)                                                       \
    static inline V vmax(V a, V b) {                                                       \
        const VI take_a = a > b;                                                           \
        return (V)(((VI)a & take_a) | ((VI)b & ~take_a));                                  \
    }                                                                                      \
    static inline V exp(V x) {                                                             \
        x = vmax(x, (V){0} - 87.0f);                                                       \
        const VI ki = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, VI);       \
        const V k = __builtin_convertvector(ki, V);                                        \
        V r = x - k * 0.693359375f;                                                        \
        r = r - k * -2.12194440e-4f;                                                       \
        V p = (V){0} + 1.9875691500e-4f;                                                   \
        p = p * r + 1.3981999507e-3f;                                                      \
        p = p * r + 8.3334519073e-3f;                                                      \
        p = p * r + 4.1665795894e-2f;                                                      \
        p = p * r + 1.6666665459e-1f;                                                      \
        p = p * r + 5.0000001201e-1f;                                                      \
        p = p * r * r + r + 1.0f;                                                          \
        return p * (V)((ki + 127) << 23);                                                  \
    }

#endif
