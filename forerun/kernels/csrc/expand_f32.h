/* One weight row of GGUF blocks expanded to fp32, exactly gguf's values (gguf_blocks.h): what the
 * block matmuls (gemm_blocks.c, gemm_lanes.c) hold in their cache-resident tiles and what
 * dequant_blocks.c returns. Each path (AVX-512, AVX2, portable) stores the same values; the vector
 * ones only decode faster. */
#ifndef FORERUN_EXPAND_F32_H
#define FORERUN_EXPAND_F32_H
#include "gguf_blocks.h"

/* out[0..k) = the k weights of `row`. */
static inline __attribute__((always_inline)) void expand_f32(int fmt, const uint8_t *row, int64_t k, float *out) {
    const int bw = block_weights(fmt), bs = block_bytes(fmt);
    for (int64_t blk = 0; blk < k / bw; blk++) {
        const uint8_t *p = row + blk * bs;
        float a[16], b[16], *o = out + blk * bw;
#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
        block_maps_avx2(fmt, p, a, b);
        UNROLL_RUNS
        for (int v = 0; v < bw / 16; v++)
            _mm512_storeu_ps(o + 16 * v, weights16_avx512(fmt, p, v, a[map_of(fmt, v)], b[map_of(fmt, v)]));
#elif defined(__AVX2__) && defined(__FMA__)
        block_maps_avx2(fmt, p, a, b);
        UNROLL_RUNS
        for (int v = 0; v < bw / 16; v++) {
            __m256 w[2];
            weights16_avx2(fmt, p, v, a[map_of(fmt, v)], b[map_of(fmt, v)], w);
            _mm256_storeu_ps(o + 16 * v, w[0]);
            _mm256_storeu_ps(o + 16 * v + 8, w[1]);
        }
#else
        block_maps(fmt, p, a, b);
        for (int v = 0; v < bw / 16; v++) weights16(fmt, p, v, a[map_of(fmt, v)], b[map_of(fmt, v)], o + 16 * v);
#endif
    }
}
#endif
