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

/* out[r, i] = silu(gu[r, i]) * gu[r, inter + i]. 16 lanes at a time with AVX-512: the exp's
 * instructions bound it (2,048 x 1,408 bf16 took 1.6 ms at 8 lanes); without it 8, since GCC keeps a
 * 16-wide vector in two AVX2 registers and the exp's temporaries then left the registers (one row of
 * 8,192, AMD EPYC with AVX2 only: 24.7 us at 16 lanes, 7.7 at 8). Every width computes the same bits. */
#define SILU_MUL(NAME, T, LD, ST, LD8, ST8, LD16, ST16)                                            \
    void NAME(const T *gu, T *out, int64_t rows, int64_t inter, int nthreads) {                    \
        _Pragma("omp parallel for num_threads(nthreads) schedule(static)")                         \
        for (int64_t r = 0; r < rows; r++) {                                                       \
            const T *g = gu + r * 2 * inter, *u = g + inter;                                       \
            T *o = out + r * inter;                                                                \
            int64_t i = 0;                                                                         \
            for (; VEC16_NATIVE && i + 16 <= inter; i += 16) {                                     \
                const v16f a = LD16(g + i);                                                        \
                ST16(o + i, a / (splat16(1.f) + exp16(-a)) * LD16(u + i));                         \
            }                                                                                      \
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
SILU_MUL(silu_mul_f32, float, ld_f32, st_f32, load8_f32, store8_f32, load16_f32, store16_f32)
SILU_MUL(silu_mul_bf16, uint16_t, ld_bf16, st_bf16, load8_bf16, store8_bf16, load16_bf16, store16_bf16)

/* out[t, h] = x[t, h] * cos[t] + swap_halves(x[t, h]) * sin[t] (rotate-half, the "neox" form), where
 * cos[t] = (cos, cos) and sin[t] = (-sin, sin) of token t's angles (D values each, rows
 * cos_sin_stride apart: the model's rotary table);
 * x rows are x_stride apart (q and k inside the packed q/k/v output), out is [tokens, heads, D].
 * The result equals the stock ops' (torch.addcmul(x * cos, swapped, sin)) bit for bit:
 *  - fp32: x * cos is rounded, then swapped * sin is added in one fused multiply-add, as addcmul does;
 *  - bf16: every op computes in fp32 and rounds its result to bf16 (addcmul's product of two bf16
 *    values is exact in fp32, so fused or not, one rounding to fp32, then one to bf16).
 * Automatic FMA contraction is turned off here (in fp32 it could fuse the other product) and only
 * here. */
#if defined(__clang__)
#define NO_CONTRACT
#define CONTRACT_OFF _Pragma("clang fp contract(off)")
#else
#define NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#define CONTRACT_OFF
#endif
NO_CONTRACT static inline float rotate_f32(float a, float c, float b, float s) { return fmaf(b, s, a * c); }

NO_CONTRACT static inline float rotate_bf16(float a, float c, float b, float s) {
    uint16_t ac;
    st_bf16(&ac, a * c);
    return ld_bf16(&ac) + b * s;
}

/* bf16's rotation 16 lanes at a time, the same bits as rotate_bf16's (the scalar loop did not vectorise). */
NO_CONTRACT static inline v16f rotate16_bf16(v16f a, v16f c, v16f b, v16f s) {
    return round16_bf16(a * c) + b * s;
}

/* fp32 keeps the scalar loop: GCC's vectors have no fused multiply-add to pin which product is fused. */
#define NO_VECTOR_RUN(xh, c, s, o, half) 0

NO_CONTRACT static inline int64_t rotate16_bf16_run(const uint16_t *xh, const uint16_t *c, const uint16_t *s,
                                                    uint16_t *o, int64_t half) {
    int64_t i = 0;
    for (; i + 16 <= half; i += 16) {
        const v16f a = load16_bf16(xh + i), b = load16_bf16(xh + half + i);
        store16_bf16(o + i, rotate16_bf16(a, load16_bf16(c + i), b, load16_bf16(s + i)));
        store16_bf16(o + half + i, rotate16_bf16(b, load16_bf16(c + half + i), a, load16_bf16(s + half + i)));
    }
    return i;
}

#define ROTARY(NAME, T, LD, ST, ROTATE, ROTATE16)                                                    \
    NO_CONTRACT void NAME(const T *x, int64_t x_stride, const T *cos, const T *sin,                  \
                          int64_t cos_sin_stride, T *out, int64_t tokens, int64_t heads, int64_t D,  \
                          int nthreads) {                                                            \
        CONTRACT_OFF                                                                                 \
        const int64_t half = D / 2;                                                                  \
        _Pragma("omp parallel for num_threads(nthreads) schedule(static)")                           \
        for (int64_t t = 0; t < tokens; t++) {                                                       \
            const T *c = cos + t * cos_sin_stride, *s = sin + t * cos_sin_stride;                    \
            for (int64_t h = 0; h < heads; h++) {                                                    \
                const T *xh = x + t * x_stride + h * D;                                              \
                T *o = out + (t * heads + h) * D;                                                    \
                for (int64_t i = ROTATE16(xh, c, s, o, half); i < half; i++) {                       \
                    const float a = LD(&xh[i]), b = LD(&xh[half + i]);                               \
                    ST(&o[i], ROTATE(a, LD(&c[i]), b, LD(&s[i])));                                   \
                    ST(&o[half + i], ROTATE(b, LD(&c[half + i]), a, LD(&s[half + i])));              \
                }                                                                                    \
            }                                                                                        \
        }                                                                                            \
    }

ROTARY(rotary_f32, float, ld_f32, st_f32, rotate_f32, NO_VECTOR_RUN)
ROTARY(rotary_bf16, uint16_t, ld_bf16, st_bf16, rotate_bf16, rotate16_bf16_run)
