/* Writing a block matmul's staged outputs back to y, row-major, as fp32 or rounded to bf16: shared by
 * gemm_blocks.c and gemm_lanes.c, which both stage a weight row's outputs for consecutive rows of x. */
#pragma once
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "transpose16.h"

/* fp32 -> bf16, to nearest even; NaN stays a (quiet) NaN, as torch rounds. */
static inline uint16_t to_bf16(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    return v != v ? 0x7FC0 : (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
static inline __m256i to_bf16_avx512(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
}
#endif

/* y[r0 + r][j0 + c] = acc[c][r] for r < nr, c < nc: the staging buffer (a weight row's outputs for
 * consecutive rows of x, `ld` apart) written back row-major (rows ldy apart), as fp32 or rounded to bf16. */
static void store_y(const float *acc, int64_t ld, int64_t nr, int64_t nc, void *y, int ybf16, int64_t ldy, int64_t r0,
                    int64_t j0) {
    for (int64_t r = 0; r < nr; r += 16) { /* 16 rows at a time, each row's segment in one burst */
        const int64_t rn = nr - r < 16 ? nr - r : 16;
        int64_t c = 0;
#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
        for (; c + 16 <= nc; c += 16) {
            __m512i v[16];
            for (int i = 0; i < 16; i++) v[i] = _mm512_loadu_si512(acc + (c + i) * ld + r);
            transpose16(v);
            for (int i = 0; i < rn; i++) {
                const int64_t at = (r0 + r + i) * ldy + j0 + c;
                if (ybf16) _mm256_storeu_si256((__m256i *)((uint16_t *)y + at), to_bf16_avx512(_mm512_castsi512_ps(v[i])));
                else _mm512_storeu_si512((float *)y + at, v[i]);
            }
        }
#endif
        for (int i = 0; i < rn; i++)
            for (int64_t cc = c; cc < nc; cc++) {
                const int64_t at = (r0 + r + i) * ldy + j0 + cc;
                if (ybf16) ((uint16_t *)y)[at] = to_bf16(acc[cc * ld + r + i]);
                else ((float *)y)[at] = acc[cc * ld + r + i];
            }
    }
}

