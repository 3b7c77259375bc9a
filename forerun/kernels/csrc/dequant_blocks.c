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
#include "expand_f32.h"
#include "gguf_blocks.h"

/* out [rows, k] fp32 from w [rows, stride] bytes (each row k / block weights blocks of format `fmt`).
 * Returns 0, or -1 for a format gguf_blocks.h lacks or a k / stride / row count that does not fit. */
int dequant_rows_f32(const uint8_t *w, int64_t stride, int fmt, int64_t rows, int64_t k, float *out, int nthreads) {
    if (!rows_fit(fmt, k, stride) || rows < 0) return -1;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = 0; r < rows; r++) WITH_FORMAT(fmt, F, expand_f32(F, w + r * stride, k, out + r * k));
    return 0;
}
