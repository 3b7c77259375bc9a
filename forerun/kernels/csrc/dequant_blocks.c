/* Rows of GGUF blocks -> fp32 [rows, k], bit-identical to gguf's dequantizer (gguf.quants.dequantize),
 * for every format gguf_blocks.h decodes.
 *
 * Why: a weight kept as blocks sometimes has to be read whole in fp32 (a matmul path that has no
 * block kernel, a check); this expands it with the same decoders the block GEMV and GEMM use, so
 * the three agree on every weight by construction, in one pass where the torch decoders (formats/)
 * make several over temporaries.
 *
 * Paths: AVX-512 (one register a run of 16 weights), AVX2 (two), portable C; each weight is the same
 * fma(a, s, b) on all of them (gguf_blocks.h), so they are bit-equal. Rows are split over the
 * caller's OpenMP threads.
 */
#include "gguf_blocks.h"

/* One row of k weights (k / block weights blocks at `row`) into out[0..k). */
static inline __attribute__((always_inline)) void dequant_row(int fmt, const uint8_t *row, int64_t k, float *out) {
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

/* out [rows, k] fp32 from w [rows, stride] bytes (each row k / block weights blocks of format `fmt`).
 * Returns 0, or -1 for a format gguf_blocks.h lacks or a k / stride / row count that does not fit. */
int dequant_rows_f32(const uint8_t *w, int64_t stride, int fmt, int64_t rows, int64_t k, float *out, int nthreads) {
    if (!rows_fit(fmt, k, stride) || rows < 0) return -1;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = 0; r < rows; r++) WITH_FORMAT(fmt, F, dequant_row(F, w + r * stride, k, out + r * k));
    return 0;
}
