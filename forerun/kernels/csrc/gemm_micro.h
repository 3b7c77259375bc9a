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

#if F32_AVX2_PATH
/* AVX2 fp32: the same chain, a group of 16 rows in two registers. The RB groups run one after the
 * other over the same weights (read again from L1): 6 weight rows of one group are 12 accumulators,
 * and AVX2 has 16 registers. Why an AVX2 path: without one an AVX2-only CPU ran its batches on the
 * lane matmul, whose dot products load a weight vector for every two multiply-adds; SmolLM2 Q4_1 at
 * 64 x 128/128 gave 198 against 153 tok/s (a dense fp32 copy of the weights: 224; AMD EPYC, AVX2
 * only, 2 threads). */
static inline __attribute__((always_inline)) void micro_f32_avx2(int RB, const float *xp, int64_t xs,
                                                                 const float *const wt[NC], int64_t len, int first,
                                                                 float *acc, int64_t ld) {
    for (int r = 0; r < RB; r++) {
        __m256 s[NC][2];
        for (int c = 0; c < NC; c++)
            for (int h = 0; h < 2; h++)
                s[c][h] = first ? _mm256_setzero_ps() : _mm256_load_ps(acc + c * ld + r * LANES + 8 * h);
        const float *xr = xp + r * xs;
        for (int64_t i = 0; i < len; i++) {
            const __m256 x0 = _mm256_load_ps(xr + i * LANES), x1 = _mm256_load_ps(xr + i * LANES + 8);
            for (int c = 0; c < NC; c++) {
                const __m256 wb = _mm256_broadcast_ss(wt[c] + i);
                s[c][0] = _mm256_fmadd_ps(x0, wb, s[c][0]);
                s[c][1] = _mm256_fmadd_ps(x1, wb, s[c][1]);
            }
        }
        for (int c = 0; c < NC; c++)
            for (int h = 0; h < 2; h++) _mm256_store_ps(acc + c * ld + r * LANES + 8 * h, s[c][h]);
    }
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
