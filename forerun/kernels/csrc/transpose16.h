/* A 16 x 16 transpose of 32-bit values in AVX-512 registers, shared by the block kernels. */
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

/* 16 x 16 32-bit values: dst row j = column j of src (32-bit moves only, so fp32 and bf16 pairs alike).
 * Interleaves 32-bit then 64-bit elements within 128-bit lanes, then gathers the lanes. */
static inline __attribute__((always_inline)) void transpose16(__m512i r[16]) {
    __m512i a[16], b[16];
    for (int i = 0; i < 8; i++) {
        a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* b[4i + j], lane L: column 4L + j of rows 4i .. 4i + 3 */
        b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
        b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
    }
    for (int j = 0; j < 4; j++) {
        const __m512i c0 = _mm512_shuffle_i32x4(b[j], b[4 + j], 0x44), c1 = _mm512_shuffle_i32x4(b[j], b[4 + j], 0xEE);
        const __m512i d0 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0x44);
        const __m512i d1 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], 0xEE);
        r[j] = _mm512_shuffle_i32x4(c0, d0, 0x88);
        r[4 + j] = _mm512_shuffle_i32x4(c0, d0, 0xDD);
        r[8 + j] = _mm512_shuffle_i32x4(c1, d1, 0x88);
        r[12 + j] = _mm512_shuffle_i32x4(c1, d1, 0xDD);
    }
}
#endif
