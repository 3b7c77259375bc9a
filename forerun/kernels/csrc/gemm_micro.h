/* The micro-kernels of gemm_blocks.c: one register block of outputs over one block of k, per arithmetic
 * variant and path. Included by gemm_blocks.c alone, after its F32_PATH / BF16_PATH switches. */
#pragma once

/* ---- Micro-kernels ---------------------------------------------------------------------------------
 * acc[c * ld + 16 r + l] (+)= sum over i < len of x[group r, lane l][i] w[c][i], for c < NC, r < RB:
 * started from +0 when `first`, else continued from the partial sums parked in acc (exact fp32
 * values, so the chain over k is the same as if it had not been cut). */

/* Portable fp32: the fixed fma chain over k. */
static inline __attribute__((always_inline)) void micro_f32_scalar(int RB, const float *xp, int64_t xs,
                                                                   const float *const wt[NC], int64_t len, int first,
                                                                   float *acc, int64_t ld) {
    for (int c = 0; c < NC; c++)
        for (int r = 0; r < RB; r++) {
            float s[LANES];
            for (int l = 0; l < LANES; l++) s[l] = first ? 0.f : acc[c * ld + r * LANES + l];
            for (int64_t i = 0; i < len; i++)
                for (int l = 0; l < LANES; l++) s[l] = fmaf(xp[r * xs + i * LANES + l], wt[c][i], s[l]);
            memcpy(acc + c * ld + r * LANES, s, sizeof s);
        }
}

/* Portable bf16: the products of bf16 values (exact in fp32), each added by its own fma. */
static inline __attribute__((always_inline)) void micro_bf16_scalar(int RB, const uint16_t *xp, int64_t xs,
                                                                    const uint16_t *const wt[NC], int64_t len,
                                                                    int first, float *acc, int64_t ld) {
    for (int c = 0; c < NC; c++)
        for (int r = 0; r < RB; r++) {
            float s[LANES];
            for (int l = 0; l < LANES; l++) s[l] = first ? 0.f : acc[c * ld + r * LANES + l];
            for (int64_t i = 0; i < len; i += 2) {
                const float w0 = ld_bf16(wt[c] + i), w1 = ld_bf16(wt[c] + i + 1);
                const uint16_t *xv = xp + r * xs + i * LANES;
                for (int l = 0; l < LANES; l++) {
                    s[l] = fmaf(ld_bf16(xv + 2 * l), w0, s[l]);
                    s[l] = fmaf(ld_bf16(xv + 2 * l + 1), w1, s[l]);
                }
            }
            memcpy(acc + c * ld + r * LANES, s, sizeof s);
        }
}

#if F32_PATH
static inline __attribute__((always_inline)) void micro_f32_avx512(int RB, const float *xp, int64_t xs,
                                                                   const float *const wt[NC], int64_t len, int first,
                                                                   float *acc, int64_t ld) {
    __m512 s[NC][RV];
    for (int c = 0; c < NC; c++)
        for (int r = 0; r < RB; r++) s[c][r] = first ? _mm512_setzero_ps() : _mm512_load_ps(acc + c * ld + r * LANES);
    for (int64_t i = 0; i < len; i++) {
        __m512 xv[RV];
        for (int r = 0; r < RB; r++) xv[r] = _mm512_load_ps(xp + r * xs + i * LANES);
        for (int c = 0; c < NC; c++) {
            const __m512 wb = _mm512_set1_ps(wt[c][i]);
            for (int r = 0; r < RB; r++) s[c][r] = _mm512_fmadd_ps(xv[r], wb, s[c][r]);
        }
    }
    for (int c = 0; c < NC; c++)
        for (int r = 0; r < RB; r++) _mm512_store_ps(acc + c * ld + r * LANES, s[c][r]);
}
#endif

#if BF16_PATH
static inline __attribute__((always_inline)) void micro_bf16_avx512(int RB, const uint16_t *xp, int64_t xs,
                                                                    const uint16_t *const wt[NC], int64_t len,
                                                                    int first, float *acc, int64_t ld) {
    __m512 s[NC][RV];
    for (int c = 0; c < NC; c++)
        for (int r = 0; r < RB; r++) s[c][r] = first ? _mm512_setzero_ps() : _mm512_load_ps(acc + c * ld + r * LANES);
    for (int64_t i = 0; i < len; i += 2) {
        __m512i xv[RV];
        for (int r = 0; r < RB; r++) xv[r] = _mm512_load_si512(xp + r * xs + i * LANES);
        for (int c = 0; c < NC; c++) {
            int32_t pair;
            memcpy(&pair, wt[c] + i, 4);
            const __m512bh wb = (__m512bh)_mm512_set1_epi32(pair);
            for (int r = 0; r < RB; r++) s[c][r] = _mm512_dpbf16_ps(s[c][r], (__m512bh)xv[r], wb);
        }
    }
    for (int c = 0; c < NC; c++)
        for (int r = 0; r < RB; r++) _mm512_store_ps(acc + c * ld + r * LANES, s[c][r]);
}
#endif

/* Calls MICRO with the row-vector count as a compile-time constant (one unrolled copy each). */
