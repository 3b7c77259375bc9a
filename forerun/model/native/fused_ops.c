/* Fused elementwise steps of a decoder layer, one pass over memory each instead of four or five
 * separate torch ops (and their temporaries): residual add + RMSNorm, and SiLU(gate) * up.
 * Rows are spread over the caller's OpenMP threads (torch's libgomp, bound by soname).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec.h"

/* res_out = x + residual (when residual is given, else x); out = res_out / rms(res_out) * weight.
 * The sum is rounded to T before the norm reads it, exactly as `x + residual` in torch would be. */
#define ADD_RMS_NORM(NAME, T, LD, ST)                                                              \
    void NAME(const T *x, const T *residual, const T *weight, T *out, T *res_out, int64_t rows,    \
              int64_t hidden, float eps, int nthreads) {                                           \
        _Pragma("omp parallel for num_threads(nthreads) schedule(static)")                         \
        for (int64_t r = 0; r < rows; r++) {                                                       \
            const T *xr = x + r * hidden;                                                          \
            T *rr = res_out + r * hidden;                                                          \
            float ss = 0.f;                                                                        \
            if (residual) {                                                                        \
                const T *pr = residual + r * hidden;                                               \
                for (int64_t i = 0; i < hidden; i++) ST(&rr[i], LD(&xr[i]) + LD(&pr[i]));          \
            } else if (rr != xr) {                                                                 \
                memcpy(rr, xr, sizeof(T) * (size_t)hidden);                                        \
            }                                                                                      \
            _Pragma("omp simd reduction(+ : ss)")                                                  \
            for (int64_t i = 0; i < hidden; i++) { const float v = LD(&rr[i]); ss += v * v; }      \
            const float inv = 1.f / sqrtf(ss / (float)hidden + eps);                               \
            T *o = out + r * hidden;                                                               \
            _Pragma("omp simd")                                                                    \
            for (int64_t i = 0; i < hidden; i++) ST(&o[i], LD(&rr[i]) * inv * LD(&weight[i]));     \
        }                                                                                          \
    }

/* out[r, i] = silu(gu[r, i]) * gu[r, inter + i] */
#define SILU_MUL(NAME, T, LD, ST, LD8, ST8)                                                        \
    void NAME(const T *gu, T *out, int64_t rows, int64_t inter, int nthreads) {                    \
        _Pragma("omp parallel for num_threads(nthreads) schedule(static)")                         \
        for (int64_t r = 0; r < rows; r++) {                                                       \
            const T *g = gu + r * 2 * inter, *u = g + inter;                                       \
            T *o = out + r * inter;                                                                \
            int64_t i = 0;                                                                         \
            for (; i + 8 <= inter; i += 8) {                                                       \
                const v8f a = LD8(g + i);                                                          \
                ST8(o + i, a / (splat8(1.f) + exp8(-a)) * LD8(u + i));                             \
            }                                                                                      \
            for (; i < inter; i++) {                                                               \
                const float a = LD(&g[i]);                                                         \
                ST(&o[i], a / (1.f + expf(-a)) * LD(&u[i]));                                       \
            }                                                                                      \
        }                                                                                          \
    }

ADD_RMS_NORM(add_rms_norm_f32, float, ld_f32, st_f32)
ADD_RMS_NORM(add_rms_norm_bf16, uint16_t, ld_bf16, st_bf16)
SILU_MUL(silu_mul_f32, float, ld_f32, st_f32, load8_f32, store8_f32)
SILU_MUL(silu_mul_bf16, uint16_t, ld_bf16, st_bf16, load8_bf16, store8_bf16)
