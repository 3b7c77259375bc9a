/* The fixed tree that adds an output's 16 lanes (lane l + 8, then + 4, + 2, + 1): the scalar form and
 * the AVX form, bit-equal, shared by the GEMVs whose every path keeps 16 lanes an output. */
#ifndef FORERUN_SUM_TREE_H
#define FORERUN_SUM_TREE_H
#if defined(__AVX2__)
#include <immintrin.h>
#endif

/* The tree's last three levels over 8 lanes (l + 4, then + 2, + 1). */
static inline float tree8(const float s[8]) {
    float t4[4];
    for (int l = 0; l < 4; l++) t4[l] = s[l] + s[l + 4];
    return (t4[0] + t4[2]) + (t4[1] + t4[3]);
}

static inline float tree16(const float s[16]) {
    float t8[8];
    for (int l = 0; l < 8; l++) t8[l] = s[l] + s[l + 8];
    return tree8(t8);
}

#if defined(__AVX2__)
/* The tree's last three levels over lanes 0-7 (= s[l] + s[l + 8] already added). */
static inline float tree8_avx(__m256 s8) {
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}
#endif
#endif
