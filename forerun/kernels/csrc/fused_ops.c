/* Fused elementwise steps of a decoder layer, one pass over memory each instead of four or five
 * separate torch ops (and their temporaries): residual add + RMSNorm, SiLU(gate) * up, and the
 * rotary embedding of q and k.
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

/* out[t, h] = x[t, h] * cos[t] + swap_halves(x[t, h]) * sin[t] (rotate-half, the "neox" form), where
 * cos[t] = (cos, cos) and sin[t] = (-sin, sin) of token t's angles (D values each, rows
 * cos_sin_stride apart: the model's rotary table);
 * x rows are x_stride apart (q and k inside the packed q/k/v output), out is [tokens, heads, D].
 * fp32 only. x * cos is rounded, then swapped * sin is added in one fused multiply-add, exactly as
 * torch's addcmul(x * cos, swapped, sin) computes it, so the result equals the stock ops' bit for bit:
 * automatic FMA contraction is turned off here (it could fuse the other product) and only here. */
#if defined(__clang__)
#define NO_CONTRACT
#else
#define NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#endif
NO_CONTRACT void rotary_f32(const float *x, int64_t x_stride, const float *cos, const float *sin,
                            int64_t cos_sin_stride, float *out, int64_t tokens, int64_t heads, int64_t D,
                            int nthreads) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
    const int64_t half = D / 2;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * cos_sin_stride, *s = sin + t * cos_sin_stride;
        for (int64_t h = 0; h < heads; h++) {
            const float *xh = x + t * x_stride + h * D;
            float *o = out + (t * heads + h) * D;
            for (int64_t i = 0; i < half; i++) {
                const float a = xh[i], b = xh[half + i];
                o[i] = fmaf(b, s[i], a * c[i]);
                o[half + i] = fmaf(a, s[half + i], b * c[half + i]);
            }
        }
    }
}
