/* Fused fp32 CPU kernels for one decode step of the compact decoder (hybridrl/rollout/decoder.py).
 *
 * A decode step multiplies a few dozen rows by every weight matrix; around those matmuls each layer
 * ran about forty small torch ops (norms, rotary, cache write, attention, activation), each paying a
 * dispatch for a few kilobytes of work. The first three kernels below do the same arithmetic in three
 * calls per layer; the fourth picks each row's next token (about ten ops per step before). The last
 * section is the step's matmuls themselves (hr_dense, AVX-512 or AVX2), ordered so that reading the weights
 * and computing on them overlap. Built at run time by hybridrl/rollout/cpu_kernels.py with the machine's C compiler and
 * -ffp-contract=off, so a product followed by a sum is rounded as torch rounds it (no fused
 * multiply-add): the rotary embedding and the activation give torch's values; the norm's and the
 * attention's sums are added in another order (differences of a few ulp). hr_dense's products use
 * fused multiply-adds on purpose: its sums run in another order than any GEMM's anyway.
 *
 * Layouts (all contiguous, row-major, float32):
 *   hidden, x, out   (rows, width)
 *   qkv              (rows, qkv_stride): q heads, then k heads, then v heads, head_dim each
 *   cos, ssin        (rows, head_dim): rotary cos, and sin with its first half negated
 *   kcache, vcache   slot s of (row r, kv head h) at r * row_stride + h * head_stride + s * head_dim
 *   valid            (rows, valid_stride) bytes: slot holds a real token
 *   source           (rows,) int64: the cache row holding row r's shared prompt slots (optional)
 */

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../utils/hr_simd.h" /* hv, hm, lanes, transpose16, transpose_rows16 */

#define MAX_GROUP 64 /* query heads per kv head handled on the stack */

/* A float16 KV cache (`kv_cache_dtype=float16`) needs F16C conversions; without them
 * hr_kv_half_supported() is 0 and the Python side never asks for one. */
#if HR_SIMD && defined(__F16C__)
#define HR_KV_HALF 1
#else
#define HR_KV_HALF 0
#endif
#define HR_KV_BYTES(half) ((half) ? 2 : 4) /* bytes of one cache element; strides count elements */

/* A float16 cache row read by the generic attention: widened into a buffer on the stack (in L1) with
 * vector conversions before the float32 loops read it. The compiler does not vectorise a load of
 * _Float16 with F16C alone (one element at a time). HR_HALF_ROW bounds the head size (checked). */
#define HR_HALF_ROW 512
#if HR_KV_HALF
static inline void halves_to_floats(const uint16_t *x, float *y, int64_t n) {
    int64_t i = 0;
#if HR_SIMD == 512
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(x + i))));
#endif
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(x + i))));
    for (; i < n; i++) y[i] = _cvtsh_ss(x[i]);
}
#endif

/* Row p of d elements as floats: p itself (float32), or with `half` (a constant at every call site)
 * p's float16 values widened into buf. */
static inline __attribute__((always_inline)) const float *kv_row(const char *p, float *buf, int64_t d, const int half) {
#if HR_KV_HALF
    if (half) {
        halves_to_floats((const uint16_t *)p, buf, d);
        return buf;
    }
#else
    (void)buf, (void)d, (void)half;
#endif
    return (const float *)p;
}

/* Slot t's row of d elements: from the shared base below `shared`, else the row's own. */
#define HR_SLOT_AT(shared_base, own_base, t, half)                                                         \
    ((const char *)((t) < shared ? (shared_base) : (own_base)) + ((t) < shared ? (t) : (t) - shared) * d * HR_KV_BYTES(half))

/* Requests slot row p (d elements) line by line; locality 3 into L1, 2 into L2. */
#define HR_PREFETCH_ROW(p, locality)                                                                      \
    for (int64_t i_ = 0; i_ < d * HR_KV_BYTES(half); i_ += 64) __builtin_prefetch((p) + i_, 0, (locality))

/* The value pass requests the next (row, head)'s slot t (the key pass's tail has its first KV_AHEAD):
 * the key pass asks for a slot's keys and values, the value pass read nothing from memory, and the
 * stream paused there on every (row, head) (SmolLM2, 32 rows, 30 layers' caches cycled, two threads,
 * a Zen 4: 128 positions 0.36 -> 0.28 ms a layer, 448 positions 1.05 -> 0.79). Into L2: the key pass
 * moves them on to L1 as it reads ahead. */
#define HR_PREFETCH_NEXT(t) HR_PREFETCH_ROW(HR_SLOT_AT(next_pkeys, next_keys, (t), half), 2)

/* The norm and the activation split their rows over the threads from this many values on (32 SmolLM2
 * rows are 18432 and 49152). With the earlier threshold of 65536, a 32-row decode step ran both on
 * one thread while the other waited; two threads on a Zen 4, per call: silu 21.9 -> 15.4 us and norm
 * 6.5 -> 5.3 us at SmolLM2's shapes, 28.2 -> 12.4 and 4.4 -> 3.7 us at the tiny model's 128 rows. */
#define ROWWISE_SPLIT (1 << 13)

/* hidden += x (when x is not NULL); out = weight * (hidden * 1 / sqrt(mean(hidden^2) + eps)) */
void hr_add_rms_norm(float *hidden, const float *x, const float *weight, float *out, int64_t rows,
                     int64_t width, float eps, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (rows * width >= ROWWISE_SPLIT)
    for (int64_t r = 0; r < rows; r++) {
        float *h = hidden + r * width;
        if (x) {
            const float *xr = x + r * width;
            for (int64_t i = 0; i < width; i++) h[i] += xr[i];
        }
        float squares = 0.f;
        for (int64_t i = 0; i < width; i++) squares += h[i] * h[i];
        float inv = 1.f / sqrtf(squares / (float)width + eps);
        float *o = out + r * width;
        for (int64_t i = 0; i < width; i++) o[i] = weight[i] * (h[i] * inv);
    }
}

/* out[r, i] = silu(gate_up[r, i]) * gate_up[r, width + i], silu(g) = g / (1 + exp(-g)); with SIMD
 * the update's SwiGLU arithmetic (hv_swiglu), so the rollout and the trainer agree on it */
void hr_silu_mul(const float *gate_up, float *out, int64_t rows, int64_t width, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (rows * width >= ROWWISE_SPLIT)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * width;
        const float *u = g + width;
        float *o = out + r * width;
#if HR_SIMD
        hv_swiglu_row(g, u, 16, o, width, 0);
#else
        for (int64_t i = 0; i < width; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
#endif
    }
}

static inline void rotate(const float *x, const float *cos, const float *ssin, float *out, int64_t d) {
    int64_t half = d / 2;
    for (int64_t i = 0; i < half; i++) out[i] = x[i] * cos[i] + x[i + half] * ssin[i];
    for (int64_t i = half; i < d; i++) out[i] = x[i] * cos[i] + x[i - half] * ssin[i];
}

#define KV_AHEAD 8 /* cache slots read ahead of the one being scored */
#define MAX_FIXED 512 /* group * head_dim of the largest shape specialised below */

/* exp(x[i] - top) for i < count into out (when not NULL), and their sum: the sampling's block sums
 * and a block's weights come from this one function, so they add up the same values. With SIMD,
 * hv_exp_sum (the compiler's vectorised expf was a libm call per 4 values on a Zen 1, 5% of a tiny
 * rollout); it gives 0 below -87.3, so a weight is positive exactly when x[i] - top >= EXP_LOWEST. */
#define EXP_LOWEST (-87.33654f)
static inline float exp_sum(const float *x, float top, int64_t count, float *out) {
#if HR_SIMD
    return hv_exp_sum(x, top, count, out, 0);
#else
    float sum = 0.f;
    for (int64_t i = 0; i < count; i++) {
        float e = x[i] - top >= EXP_LOWEST ? expf(x[i] - top) : 0.f;
        if (out) out[i] = e;
        sum += e;
    }
    return sum;
#endif
}

/* Softmax numerators in place: weights (group, length) -> exp(score - top[g]), their sums into total. */
static inline __attribute__((always_inline)) void exp_scores(float *weights, int64_t length, int64_t group,
                                                             const float *top, float *total) {
    for (int64_t g = 0; g < group; g++) total[g] = exp_sum(weights + g * length, top[g], length, weights + g * length);
}

/* Attention of `group` rotated queries (group, d) over slots [0, length) of one kv head: scores into
 * weights (group, length), softmax over the valid slots, the weighted sum of the values into o
 * (group, d), accumulated in acc (o itself, or a buffer the compiler can keep in registers). Slots
 * below `shared` are read from pkeys / pvalues (a prompt stored once for all its samples), slot t
 * from `shared` on at index t - shared of keys / values (the row's own); shared == 0: all the row's.
 *
 * The cache is read once per step and is far larger than the caches, and each (row, head) is a
 * short stream of a few kilobytes that the hardware prefetcher barely starts on: the keys are
 * requested KV_AHEAD slots ahead of the one being scored, and each slot's values (read by the
 * second pass) alongside it; the last slots read ahead into the next (row, head)'s keys, so its
 * stream starts warm. A prefetch never faults, so reading ahead past the last slot is safe. */
static inline __attribute__((always_inline)) void attend_into(const float *queries, const void *pkeys,
        const void *pvalues, const void *keys, const void *values, int64_t shared, const uint8_t *ok,
        int64_t length, float scale, float *weights, float *acc, float *o, const int64_t group, const int64_t d,
        const void *next_pkeys, const void *next_keys, const int half) {
    float top[MAX_GROUP], total[MAX_GROUP], widened[HR_HALF_ROW];
    for (int64_t g = 0; g < group; g++) top[g] = -1e30f;
    for (int64_t t = 0; t < length; t++) {
        const char *k = HR_SLOT_AT(pkeys, keys, t, half), *v = HR_SLOT_AT(pvalues, values, t, half);
        const char *ahead = t + KV_AHEAD < length ? HR_SLOT_AT(pkeys, keys, t + KV_AHEAD, half)
                                                  : HR_SLOT_AT(next_pkeys, next_keys, t + KV_AHEAD - length, half);
        HR_PREFETCH_ROW(ahead, 3);
        HR_PREFETCH_ROW(v, 2);
        const float *kf = kv_row(k, widened, d, half);
        for (int64_t g = 0; g < group; g++) {
            const float *q = queries + g * d;
            float dot = 0.f;
            for (int64_t i = 0; i < d; i++) dot += q[i] * kf[i];
            float score = ok[t] ? dot * scale : -1e30f; /* exp(-1e30 - top) is 0 */
            weights[g * length + t] = score;
            top[g] = score > top[g] ? score : top[g];
        }
    }
    exp_scores(weights, length, group, top, total);
    for (int64_t i = 0; i < group * d; i++) acc[i] = 0.f;
    for (int64_t t = 0; t < length; t++) {
        if (t >= KV_AHEAD) HR_PREFETCH_NEXT(t);
        const float *vf = kv_row(HR_SLOT_AT(pvalues, values, t, half), widened, d, half);
        for (int64_t g = 0; g < group; g++) {
            float w = weights[g * length + t];
            for (int64_t i = 0; i < d; i++) acc[g * d + i] += w * vf[i];
        }
    }
    for (int64_t g = 0; g < group; g++) {
        float inv = 1.f / total[g];
        for (int64_t i = 0; i < d; i++) o[g * d + i] = acc[g * d + i] * inv;
    }
}

/* One shape with group and d known to the compiler: loops unrolled, the sums in registers. */
static inline __attribute__((always_inline)) void attend_fixed(const float *queries, const void *pkeys,
        const void *pvalues, const void *keys, const void *values, int64_t shared, const uint8_t *ok,
        int64_t length, float scale, float *weights, float *o, const int64_t group, const int64_t d,
        const void *next_pkeys, const void *next_keys, const int half) {
    float acc[MAX_FIXED];
    attend_into(queries, pkeys, pvalues, keys, values, shared, ok, length, scale, weights, acc, o, group, d,
                next_pkeys, next_keys, half);
}

#if HR_SIMD == 512
/* 16 cache values from element i of p as floats: float32, or float16 (`half`, a constant at every
 * call site, so each caller's loop has one of the two loads). */
static inline __attribute__((always_inline)) __m512 load_kv16(const void *p, int64_t i, const int half) {
    return half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)))
                : _mm512_loadu_ps((const float *)p + i);
}

/* head_dim 64 with the group's queries and sums in registers (four vectors per head); the cache
 * float32 or float16 (`half`: converted in registers as it is read, no copy). */
static inline __attribute__((always_inline)) void attend64(const float *queries, const void *pkeys,
        const void *pvalues, const void *keys, const void *values, int64_t shared, const uint8_t *ok,
        int64_t length, float scale, float *weights, float *o, const int64_t group, const void *next_pkeys,
        const void *next_keys, const int half) {
    const int64_t d = 64;
    __m512 q[8][4], a[8][4];
    float top[8], total[8];
    for (int64_t g = 0; g < group; g++) {
        top[g] = -1e30f;
        for (int j = 0; j < 4; j++) q[g][j] = _mm512_loadu_ps(queries + g * 64 + 16 * j);
    }
    for (int64_t t = 0; t < length; t++) {
        const char *k = HR_SLOT_AT(pkeys, keys, t, half), *v = HR_SLOT_AT(pvalues, values, t, half);
        const char *ahead = t + KV_AHEAD < length ? HR_SLOT_AT(pkeys, keys, t + KV_AHEAD, half)
                                                  : HR_SLOT_AT(next_pkeys, next_keys, t + KV_AHEAD - length, half);
        HR_PREFETCH_ROW(ahead, 3);
        HR_PREFETCH_ROW(v, 2);
        __m512 k0 = load_kv16(k, 0, half), k1 = load_kv16(k, 16, half), k2 = load_kv16(k, 32, half),
               k3 = load_kv16(k, 48, half);
        for (int64_t g = 0; g < group; g++) {
            __m512 p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(q[g][0], k0), _mm512_mul_ps(q[g][1], k1)),
                                     _mm512_add_ps(_mm512_mul_ps(q[g][2], k2), _mm512_mul_ps(q[g][3], k3)));
            float score = ok[t] ? _mm512_reduce_add_ps(p) * scale : -1e30f; /* exp(-1e30 - top) is 0 */
            weights[g * length + t] = score;
            top[g] = score > top[g] ? score : top[g];
        }
    }
    exp_scores(weights, length, group, top, total);
    for (int64_t g = 0; g < group; g++)
        for (int j = 0; j < 4; j++) a[g][j] = _mm512_setzero_ps();
    for (int64_t t = 0; t < length; t++) {
        const char *v = HR_SLOT_AT(pvalues, values, t, half);
        if (t >= KV_AHEAD) HR_PREFETCH_NEXT(t);
        __m512 v0 = load_kv16(v, 0, half), v1 = load_kv16(v, 16, half), v2 = load_kv16(v, 32, half),
               v3 = load_kv16(v, 48, half);
        for (int64_t g = 0; g < group; g++) {
            __m512 w = _mm512_set1_ps(weights[g * length + t]);
            a[g][0] = _mm512_add_ps(a[g][0], _mm512_mul_ps(w, v0));
            a[g][1] = _mm512_add_ps(a[g][1], _mm512_mul_ps(w, v1));
            a[g][2] = _mm512_add_ps(a[g][2], _mm512_mul_ps(w, v2));
            a[g][3] = _mm512_add_ps(a[g][3], _mm512_mul_ps(w, v3));
        }
    }
    for (int64_t g = 0; g < group; g++) {
        __m512 inv = _mm512_set1_ps(1.f / total[g]);
        for (int j = 0; j < 4; j++) _mm512_storeu_ps(o + g * 64 + 16 * j, _mm512_mul_ps(a[g][j], inv));
    }
}
#define HR_ATTEND64(G, HALF) if (group == G && d == 64) { attend64(queries, pkeys, pvalues, keys, values, shared, ok, length, scale, weights, o, G, next_pkeys, next_keys, HALF); return; }
#else
#define HR_ATTEND64(G, HALF)
#endif
#undef HR_PREFETCH_NEXT
#undef HR_PREFETCH_ROW
#undef HR_SLOT_AT

/* the common (group, head_dim) pairs specialised (1.3x on this file's attention alone), any other
 * shape through the same code with its sizes at run time; each for a float32 cache and, where
 * F16C is built in, a float16 one read in place */
#define HR_FIXED(G, D, HALF) if (group == G && d == D) { attend_fixed(queries, pkeys, pvalues, keys, values, shared, ok, length, scale, weights, o, G, D, next_pkeys, next_keys, HALF); return; }
#define HR_DISPATCH(HALF)                                                                                      \
    HR_ATTEND64(1, HALF) HR_ATTEND64(2, HALF) HR_ATTEND64(3, HALF) HR_ATTEND64(4, HALF) HR_ATTEND64(5, HALF)    \
    HR_ATTEND64(6, HALF) HR_ATTEND64(7, HALF) HR_ATTEND64(8, HALF)                                              \
    HR_FIXED(1, 64, HALF) HR_FIXED(2, 64, HALF) HR_FIXED(3, 64, HALF) HR_FIXED(4, 64, HALF)                    \
    HR_FIXED(5, 64, HALF) HR_FIXED(6, 64, HALF) HR_FIXED(7, 64, HALF) HR_FIXED(8, 64, HALF)                    \
    HR_FIXED(1, 128, HALF) HR_FIXED(2, 128, HALF) HR_FIXED(3, 128, HALF) HR_FIXED(4, 128, HALF)                \
    HR_FIXED(1, 32, HALF) HR_FIXED(2, 32, HALF) HR_FIXED(4, 32, HALF)                                           \
    attend_into(queries, pkeys, pvalues, keys, values, shared, ok, length, scale, weights, o, o, group, d, next_pkeys, next_keys, HALF);
static void attend(const float *queries, const void *pkeys, const void *pvalues, const void *keys,
                   const void *values, int64_t shared, const uint8_t *ok, int64_t length, float scale,
                   float *weights, float *o, int64_t group, int64_t d, const void *next_pkeys, const void *next_keys,
                   int half) {
#if HR_KV_HALF
    if (half) {
        HR_DISPATCH(1)
        return;
    }
#else
    (void)half;
#endif
    HR_DISPATCH(0)
}
#undef HR_DISPATCH
#undef HR_FIXED

/* ---------------------------------------------------------------------------------------------
 * A float16 KV cache (`kv_cache_dtype=float16`, opt-in): half the bytes for the decode attention to
 * read, which at long sequences is a large part of a decode step (SmolLM2, 32 rows, 576 positions:
 * 33 ms of attention beside 46 of products). Keys and values are rounded to float16 (to nearest,
 * as torch's conversion rounds the prefill's) when written, and the attention above reads them in
 * place, widening them as it loads them (attend64's vector loads; elsewhere each slot's row into an
 * L1 buffer, kv_row): the result is the fp32 kernel's on a cache holding the rounded values, to
 * float rounding. Widening every (row, head)'s slots into a float scratch first made SmolLM2 at 512
 * tokens 8% slower than the fp32 cache.
 * ------------------------------------------------------------------------------------------- */
int hr_kv_half_supported(void) { return HR_KV_HALF; }

#if HR_KV_HALF
/* n floats rounded to float16 (to nearest even, as torch converts) */
static inline void floats_to_halves(const float *x, uint16_t *y, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(y + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) y[i] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT);
}
#endif

/* One new token per row: rotate its queries and keys, store its key and value at `slot`, and attend
 * over slots [0, length) of its row (valid ones only). out (rows, heads * head_dim), query head
 * h * group + g reads kv head h (HF's repeat_kv order).
 *
 * Shared prompts (`source` not NULL): slots [0, shared) of row r are those of prompt source[r] in
 * pkcache / pvcache (strides prow_stride, phead_stride), written once by the prefill and read by
 * every sample of the prompt; the row's own cache holds slot s >= shared at index s - shared.
 *
 * The cache pointers are float32, or float16 with `half` (uint16 values; the strides count
 * elements either way; without F16C `half` is never asked for: the Python side checks
 * hr_kv_half_supported). */
void hr_decode_attention(const float *qkv, int64_t qkv_stride, const float *cos, const float *ssin,
                         void *kcache, void *vcache, int64_t row_stride, int64_t head_stride,
                         const uint8_t *valid, int64_t valid_stride, int64_t slot, int64_t length, float *out,
                         int64_t rows, int64_t heads, int64_t kv_heads, int64_t d, float scale,
                         const void *pkcache, const void *pvcache, int64_t prow_stride, int64_t phead_stride,
                         const int64_t *source, int64_t shared, int half, int nthreads) {
#if !HR_KV_HALF
    half = 0;
#endif
    if (half && d > HR_HALF_ROW) return; /* refused before the call (CpuKernels._half) */
    int64_t group = heads / kv_heads, size = HR_KV_BYTES(half);
    if (source == NULL) shared = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *weights = (float *)malloc(sizeof(float) * (size_t)(group * length));
        float *queries = (float *)malloc(sizeof(float) * (size_t)((group + 1) * d)); /* + a rotated key */
#pragma omp for schedule(static)
        for (int64_t task = 0; task < rows * kv_heads; task++) {
            int64_t r = task / kv_heads, h = task % kv_heads;
            const float *src = qkv + r * qkv_stride;
            const float *c = cos + r * d, *s = ssin + r * d;
            char *keys = (char *)kcache + (r * row_stride + h * head_stride) * size;
            char *values = (char *)vcache + (r * row_stride + h * head_stride) * size;
            const char *pkeys = keys, *pvalues = values;
            if (shared) {
                pkeys = (const char *)pkcache + (source[r] * prow_stride + h * phead_stride) * size;
                pvalues = (const char *)pvcache + (source[r] * prow_stride + h * phead_stride) * size;
            }
            const float *value = src + (heads + kv_heads + h) * d;
            if (half) { /* the new key and value, rounded to float16 into their slot */
#if HR_KV_HALF
                float *key = queries + group * d;
                rotate(src + (heads + h) * d, c, s, key, d);
                floats_to_halves(key, (uint16_t *)keys + (slot - shared) * d, d);
                floats_to_halves(value, (uint16_t *)values + (slot - shared) * d, d);
#endif
            } else {
                rotate(src + (heads + h) * d, c, s, (float *)keys + (slot - shared) * d, d);
                memcpy((float *)values + (slot - shared) * d, value, sizeof(float) * (size_t)d);
            }
            for (int64_t g = 0; g < group; g++) rotate(src + (h * group + g) * d, c, s, queries + g * d, d);
            /* the next task's shared and own slots, which this one reads ahead (the last task: its own) */
            int64_t nr = h + 1 < kv_heads ? r : r + 1, nh = h + 1 < kv_heads ? h + 1 : 0;
            const char *next_keys = keys, *next_pkeys = pkeys;
            if (nr < rows) {
                next_keys = (const char *)kcache + (nr * row_stride + nh * head_stride) * size;
                next_pkeys = shared ? (const char *)pkcache + (source[nr] * prow_stride + nh * phead_stride) * size
                                    : next_keys;
            }
            attend(queries, pkeys, pvalues, keys, values, shared, valid + r * valid_stride, length, scale, weights,
                   out + r * heads * d + h * group * d, group, d, next_pkeys, next_keys, half);
        }
        free(weights);
        free(queries);
    }
}

#define SCAN_BLOCK 256

/* Token selection over the full vocabulary, one row of logits (rows, vocab) at a time: with
 * `sample`, inverse-CDF sampling from softmax(logits / temperature) at uniforms[r] in (0, 1] (the
 * first token whose cumulative weight reaches uniforms[r] times the total, as torch.searchsorted
 * finds it in a cumsum); otherwise the first maximum. log_probs[r] = log_softmax(...) at the token.
 * `temperature` 1 skips the division (as the torch path does). */
void hr_select_tokens(const float *logits, const float *uniforms, float temperature, int sample, int64_t *tokens,
                      float *log_probs, int64_t rows, int64_t vocab, int nthreads) {
#pragma omp parallel num_threads(nthreads) if (rows * vocab >= (1 << 16))
    {
        int64_t blocks = (vocab + SCAN_BLOCK - 1) / SCAN_BLOCK;
        float *buffer = temperature != 1.f ? (float *)malloc(sizeof(float) * (size_t)vocab) : NULL;
        float *block_sums = (float *)malloc(sizeof(float) * (size_t)blocks);
        float weights[SCAN_BLOCK];
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            const float *x = logits + r * vocab, *scaled = x; /* temperature 1: the logits themselves */
            if (buffer) {
                for (int64_t i = 0; i < vocab; i++) buffer[i] = x[i] / temperature;
                scaled = buffer;
            }
            float top = scaled[0];
            for (int64_t i = 1; i < vocab; i++) top = scaled[i] > top ? scaled[i] : top;
            /* weights exp(x - max) summed per block of SCAN_BLOCK tokens (vectorised, float), the
             * blocks added in double: the total and the running sum below come from the same sums */
            double total = 0.;
            for (int64_t b = 0; b < blocks; b++) {
                int64_t end = (b + 1) * SCAN_BLOCK < vocab ? (b + 1) * SCAN_BLOCK : vocab;
                block_sums[b] = exp_sum(scaled + b * SCAN_BLOCK, top, end - b * SCAN_BLOCK, NULL);
                total += block_sums[b];
            }
            int64_t token = 0;
            if (sample) {
                /* the block where the running sum reaches the target, then token by token inside it */
                double target = (double)uniforms[r] * total, running = 0.;
                int64_t b = 0;
                while (b < blocks - 1 && running + block_sums[b] < target) running += block_sums[b++];
                int64_t first = b * SCAN_BLOCK, end = first + SCAN_BLOCK < vocab ? first + SCAN_BLOCK : vocab;
                token = -1;
                int64_t last = -1;
                /* the block's weights in one vectorised pass (the same exp as the block sums), then
                 * the running sum token by token (a scalar exp per token took most of a tiny-model row) */
                exp_sum(scaled + first, top, end - first, weights);
                for (int64_t i = first; i < end; i++) {
                    float weight = weights[i - first];
                    if (weight <= 0.f) continue;
                    last = i;
                    running += weight;
                    if (running >= target) {
                        token = i;
                        break;
                    }
                }
                if (token < 0) { /* the sums' rounding left the target just past the block */
                    token = last;
                    for (int64_t i = b * SCAN_BLOCK - 1; token < 0 && i >= 0; i--)
                        if (scaled[i] - top >= EXP_LOWEST) token = i;
                    if (token < 0) token = 0;
                }
            } else {
                while (token < vocab - 1 && scaled[token] != top) token++;
            }
            tokens[r] = token;
            if (log_probs) log_probs[r] = (float)((double)(scaled[token] - top) - log(total));
        }
        free(buffer);
        free(block_sums);
    }
}

/* ---------------------------------------------------------------------------------------------
 * Decode matmuls: out (m, n) = x (m, k) @ W^T (+ bias), W (n, k) packed by hr_pack_rows.
 *
 * A decode step multiplies a few dozen rows by every weight matrix, so each weight is read from
 * memory once per step and used for only 2m FLOPs per element: reading and arithmetic take about
 * the same time. A GEMM that reads a block of weights and then computes on it does one after the
 * other (this is where MKL's packed GEMM spent half its time at 32 rows on this CPU). Here the work
 * is ordered so the two overlap: each panel of 48 output columns is walked in chunks of HR_KC or
 * 2 HR_KC k steps; every 8-row tile of x passes over the chunk (from L1) while the next chunk is
 * prefetched, a few lines every few k steps, spread over all the tiles' passes so the memory stream
 * never pauses. Partial sums live in registers within a pass and in a small buffer between chunks.
 * ------------------------------------------------------------------------------------------- */
#define HR_NR 48   /* output columns per panel: three 16-float vectors */
#define HR_MR 8    /* x rows per register tile (8 x 3 accumulators) */
#define HR_KC 64   /* k steps per chunk for up to 3 tiles (12 KB); twice that for more tiles */
#define HR_TILES 8 /* tiles per row block: more rows are done in blocks of 64, re-reading W */

/* Floats hr_pack_rows fills for an (n, k) weight: n rounded up to whole panels, times k. */
int64_t hr_packed_floats(int64_t n, int64_t k) { return (n + HR_NR - 1) / HR_NR * HR_NR * k; }

/* Rows [0, n) of w (n, k) row-major (NULL: zeros) as columns [col0, col0 + n) of a packed matrix: panels
 * of HR_NR columns, each (k, HR_NR) contiguous. Several weights stacked along n (q, k and v; gate and
 * up) pack side by side at their column offsets, with no concatenated copy first. With SIMD and
 * col0 a multiple of 16, 16 x 16 blocks are transposed in registers (element by element, a SmolLM2
 * repack after every weight update took 100-120 ms, 53 ms so). The next block of rows is requested
 * while this one is transposed: the 16 row streams alone left the reads waiting (53 -> 25 ms). */
void hr_pack_rows(const float *w, int64_t n, int64_t k, float *out, int64_t col0, int nthreads) {
#if HR_SIMD
    if (w && col0 % 16 == 0) { /* (the zero columns past a matrix go element by element below) */
        int64_t blocks = (n + 15) / 16;
#pragma omp parallel for num_threads(nthreads) schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            int64_t r0 = 16 * b, nr = n - r0 < 16 ? n - r0 : 16, col = col0 + r0;
            float *dst = out + col / HR_NR * k * HR_NR + col % HR_NR;
            /* the next rows' lines spread evenly over this block's columns (front-loading them, as the
             * update's transposes do, took 30 instead of 23 ms for SmolLM2's weights) */
            transpose_rows16(w + r0 * k, k, nr, k, b + 1 < blocks ? w + (r0 + 16) * k : NULL, 16, dst, HR_NR,
                             nr == 16 && ((uintptr_t)dst & 63) == 0);
        }
        _mm_sfence();
        return;
    }
#endif
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = 0; r < n; r++) {
        int64_t col = col0 + r;
        float *dst = out + col / HR_NR * k * HR_NR + col % HR_NR;
        for (int64_t kk = 0; kk < k; kk++) dst[kk * HR_NR] = w ? w[r * k + kk] : 0.f;
    }
}

#if HR_SIMD
int hr_dense_supported(void) { return 1; }

/* The next chunk's lines are requested into L1 (`l2` 0) or only into L2 (`l2` 1), the latter up to
 * HR_L2_TILES 8-row tiles: with few rows the products are few and the kernel waits on the weights,
 * and L2 requests keep more of them in flight than L1's fill buffers allow. SmolLM2's layer
 * products, two threads, a Zen 4, GFLOP/s with L1 / L2 requests: 4 rows 37-40 / 57-58, 8 rows 71-73
 * / 99-110, 12 rows 97 / 108, 16 rows 125-130 / 139-146, 24 rows 150-155 / 148-155, 32 rows 171-175
 * / 166-171, 64 rows 174-182 / 176-179; the AVX2 build on it: 4 rows 26 / 36, 8 rows 51 / 71, 16
 * rows 83 / 113, 24 rows 105 / 128, 32 rows 114 / 122, 64 rows 136 / 135. */
#if HR_SIMD == 512
#define HR_L2_TILES 2
#else
#define HR_L2_TILES 4
#endif
#define HR_PREFETCH_CHUNK(p, l2)                          \
    do {                                                 \
        if (l2)                                          \
            _mm_prefetch((p), _MM_HINT_T1);              \
        else                                             \
            _mm_prefetch((p), _MM_HINT_T0);              \
    } while (0)

/* Where the lines of the next chunks are: `hr_dense` reads `streams` panels side by side (1, 2 or 4)
 * and requests their next chunks a line of each in turn, line i at stream i & mask, line i >> shift
 * of it (see hr_dense). */
#define HR_MAX_STREAMS 4
typedef struct {
    const char *at[HR_MAX_STREAMS];
    int64_t mask, shift;
} hr_ahead;
#define HR_AHEAD_LINE(a, i) ((a)->at[(i) & (a)->mask] + ((i) >> (a)->shift) * 64)

#if HR_SIMD == 512
/* One 8-row tile over `len` k steps of a panel chunk `w` (len, 48): the chunk's products are summed
 * in registers from zero, then added to acc (rows 48 floats apart; set when `first`): blocked
 * summation, whose rounding error grows with the chunk length + k / chunk length rather than with
 * k. Only the first `nv` 16-column vectors are computed (all 3, fewer in a matrix's last panel: the
 * rest of acc is left as it is and never stored out). Every 4 k steps it issues up to `per4` of the
 * `lines` prefetches of the next chunks at `ahead` (*done counts those issued so far). */
static inline __attribute__((always_inline)) void hr_tile512(const float *const *x, int64_t kc, const float *w,
        int64_t len, float *acc, int first, const hr_ahead *ahead, int64_t lines, int64_t per4, int64_t *done,
        const int nv, int l2) {
    __m512 a[3 * HR_MR], wv[3];
    /* Unrolled, so that GCC does not turn the loop into a call to memset on a copy of the tile in
     * memory, loaded back into registers (a call per tile). Warm, GFLOP/s of the real columns with
     * and without the call: the tiny model's decode products at 128 rows, one thread, gate-up 98 /
     * 106, LM head 95 / 104, a step's layer products 1.55-1.59 -> 1.45-1.50 ms; SmolLM2's at 32 rows,
     * two threads, gate-up 194-201 / 211-222, down 196-202 / 213-222, LM head 182-191 / 191-202. */
#pragma GCC unroll 24
    for (int i = 0; i < 3 * HR_MR; i++) a[i] = _mm512_setzero_ps();
    const float *x0 = x[0] + kc, *x1 = x[1] + kc, *x2 = x[2] + kc, *x3 = x[3] + kc;
    const float *x4 = x[4] + kc, *x5 = x[5] + kc, *x6 = x[6] + kc, *x7 = x[7] + kc;
    int64_t issued = *done;
    __m512 b;
#define HR_ROW(r, xr, k)                                               \
        b = _mm512_set1_ps(xr[k]);                                     \
        for (int v = 0; v < nv; v++) a[3 * r + v] = _mm512_fmadd_ps(b, wv[v], a[3 * r + v]);
#define HR_STEP(k)                                                     \
    do {                                                               \
        const float *wk = w + (k) * HR_NR;                             \
        for (int v = 0; v < nv; v++) wv[v] = _mm512_loadu_ps(wk + 16 * v); \
        HR_ROW(0, x0, k) HR_ROW(1, x1, k) HR_ROW(2, x2, k) HR_ROW(3, x3, k) \
        HR_ROW(4, x4, k) HR_ROW(5, x5, k) HR_ROW(6, x6, k) HR_ROW(7, x7, k) \
    } while (0)
    /* Four k steps a turn: the next prefetches' check and the loop's branch once a turn rather than
     * every step (on Intel cores a branch can issue on port 0, one of the two FMA ports). The same
     * FMAs in the same order, so the same bits. On a Xeon (family 6, model 167), one thread, a
     * decode step's products, ms (the two builds alternating in one process): the 25M model at 64
     * rows 20.35 -> 19.61, at 48 rows 16.08 -> 15.30, the tiny model at 128 rows 1.24 -> 1.16,
     * SmolLM2 at 16 rows 43.9 -> 43.1 (32 rows, two threads, 32.8 -> 31.8); eight steps a turn were
     * no faster. The AVX2 build's passes (hr_part) unrolled alike showed no gain there, and keep one
     * step a turn. */
    int64_t kk = 0;
    for (; kk + 4 <= len; kk += 4) {
        for (int64_t i = 0; i < per4 && issued < lines; i++, issued++)
            HR_PREFETCH_CHUNK(HR_AHEAD_LINE(ahead, issued), l2);
        HR_STEP(kk);
        HR_STEP(kk + 1);
        HR_STEP(kk + 2);
        HR_STEP(kk + 3);
    }
    for (; kk < len; kk++) {
        if ((kk & 3) == 0)
            for (int64_t i = 0; i < per4 && issued < lines; i++, issued++)
                HR_PREFETCH_CHUNK(HR_AHEAD_LINE(ahead, issued), l2);
        HR_STEP(kk);
    }
#undef HR_STEP
#undef HR_ROW
    *done = issued;
    for (int r = 0; r < HR_MR; r++)
        for (int v = 0; v < nv; v++) {
            float *p = acc + r * HR_NR + 16 * v;
            _mm512_store_ps(p, first ? a[3 * r + v] : _mm512_add_ps(_mm512_load_ps(p), a[3 * r + v]));
        }
}

/* `vecs`: the panel's 8-column vectors that hold real columns (6, fewer only in a matrix's last
 * panel), so ceil(vecs / 2) 16-column ones. A last panel's empty vectors are not multiplied: the tiny
 * model's 256-column q-k-v product has 16 of its last panel's 48 columns, its 128-column ones 32 (at
 * 128 rows, one thread, a Zen 4, GFLOP/s counting only the real columns, multiplying the empty
 * vectors / not: q-k-v 86-87 / 94-95, o 82-84 / 90-93, down 89-90 / 91-100; the 768-column
 * gate-up, with no empty vectors, 99 either way). */
static inline void hr_tile(const float *const *x, int64_t kc, const float *w, int64_t len, float *acc, int first,
                           const hr_ahead *ahead, int64_t lines, int64_t per4, int64_t *done, int vecs, int l2) {
    if (vecs > 4)
        hr_tile512(x, kc, w, len, acc, first, ahead, lines, per4, done, 3, l2);
    else if (vecs > 2)
        hr_tile512(x, kc, w, len, acc, first, ahead, lines, per4, done, 2, l2);
    else
        hr_tile512(x, kc, w, len, acc, first, ahead, lines, per4, done, 1, l2);
}
#else
/* One pass of the AVX2 tile below: `rows` rows x the first `vecs` 8-column vectors of the chunk `w`
 * (rows * vecs <= 12 accumulators), summed over `len` k steps from zero and then added to acc, each
 * output's sum in the AVX-512 tile's order. The compiler unrolls it for each (rows, vecs). */
static inline __attribute__((always_inline)) void hr_part(const float *const *x, int64_t kc, const int rows,
        const int vecs, const float *w, int64_t len, float *acc, int first, const hr_ahead *ahead, int64_t lines,
        int64_t per4, int64_t *issued, int l2) {
    __m256 a[12], wv[3];
    const float *xs[8];
    for (int r = 0; r < rows; r++) xs[r] = x[r] + kc;
    for (int i = 0; i < rows * vecs; i++) a[i] = _mm256_setzero_ps();
    for (int64_t kk = 0; kk < len; kk++) {
        if ((kk & 3) == 0)
            for (int64_t i = 0; i < per4 && *issued < lines; i++, (*issued)++)
                HR_PREFETCH_CHUNK(HR_AHEAD_LINE(ahead, *issued), l2);
#pragma GCC unroll 3
        for (int v = 0; v < vecs; v++) {
            wv[v] = _mm256_loadu_ps(w + kk * HR_NR + 8 * v);
            /* in registers: the compiler otherwise folds the loads into each row's FMAs, 16 loads a k
             * step for 12 FMAs, more than two 256-bit loads a cycle keep up with */
            __asm__("" : "+x"(wv[v]));
        }
#pragma GCC unroll 8
        for (int r = 0; r < rows; r++) {
            __m256 b = _mm256_set1_ps(xs[r][kk]);
#pragma GCC unroll 3
            for (int v = 0; v < vecs; v++) a[r * vecs + v] = _mm256_fmadd_ps(b, wv[v], a[r * vecs + v]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < vecs; v++) {
            float *p = acc + r * HR_NR + 8 * v;
            __m256 sum = a[r * vecs + v];
            _mm256_store_ps(p, first ? sum : _mm256_add_ps(_mm256_load_ps(p), sum));
        }
}

/* The same tile with AVX2's 16 ymm registers: they hold a quarter of it, 4 rows x 24 columns (12
 * accumulators, 3 weight vectors, the broadcast), and the four quarters pass over the chunk in turn
 * (from L1 after the first). Each output's sum runs in the same order as above, so the results are
 * the same; the next chunk's prefetches go out during the first quarters' passes. `vecs`: the
 * panel's 8-column vectors that hold real columns (all 6, fewer only in a matrix's last panel). The
 * vectors past them are skipped (4 rows x 2 or 8 rows x 1 per pass): a 128-column matrix has 32 of
 * its last panel's 48, and multiplying the zeros took a tenth of its time (28 against 36 GFLOP/s for
 * torch's product at 128 rows, one Zen 1 core). */
static inline void hr_tile(const float *const *x, int64_t kc, const float *w, int64_t len, float *acc, int first,
                           const hr_ahead *ahead, int64_t lines, int64_t per4, int64_t *done, int vecs, int l2) {
    int64_t issued = *done;
    for (int ch = 0; ch < 2; ch++) {
        int part = vecs - 3 * ch; /* this half's real vectors */
        const float *wc = w + 24 * ch;
        float *ac = acc + 24 * ch;
        if (part >= 3)
            for (int rh = 0; rh < 2; rh++)
                hr_part(x + 4 * rh, kc, 4, 3, wc, len, ac + 4 * rh * HR_NR, first, ahead, lines, per4, &issued, l2);
        else if (part == 2)
            for (int rh = 0; rh < 2; rh++)
                hr_part(x + 4 * rh, kc, 4, 2, wc, len, ac + 4 * rh * HR_NR, first, ahead, lines, per4, &issued, l2);
        else if (part == 1) /* all 8 rows at once: 8 accumulators */
            hr_part(x, kc, 8, 1, wc, len, ac, first, ahead, lines, per4, &issued, l2);
    }
    *done = issued;
}
#endif

/* The finished panel p of `rows` rows (at r0) from its sums in acc, plus the bias, into out (m, n). */
static inline void hr_store_panel(const float *acc, int64_t p, int64_t n, const float *bias, float *out, int64_t r0,
                                  int64_t rows) {
    int64_t cols = n - p * HR_NR;
    hm mask[3] = {lanes(cols), lanes(cols - 16), lanes(cols - 32)};
    hv bv[3];
    for (int v = 0; v < 3; v++) bv[v] = bias ? hv_maskz_loadu(mask[v], bias + p * HR_NR + 16 * v) : hv_zero();
    for (int64_t r = 0; r < rows; r++) {
        float *o = out + (r0 + r) * n + p * HR_NR;
        const float *a = acc + r * 48;
        for (int v = 0; v < 3; v++) hv_mask_storeu(o + 16 * v, mask[v], hv_add(hv_loadu(a + 16 * v), bv[v]));
    }
}

/* out (m, n) row-major = x (m, k) row-major @ W^T + bias (may be NULL); `packed` from hr_pack_rows.
 * Threads split the panels (output columns); each streams its own contiguous part of `packed`.
 *
 * `streams` (1, 2 or 4): a thread splits its panels into that many runs and walks them side by side,
 * one chunk of each in turn, requesting the next chunks of all of them a line of each in turn. Each
 * output's sum runs over the same chunks in the same order either way, so the results are the same
 * bits. On an Intel Xeon (virtualised, 217-305 ns to memory) one sequential stream of requests left
 * the reads and the arithmetic hardly overlapping: SmolLM2's decode products at 16 rows, one thread,
 * 53-60 ms a step against 38-40 for the reading alone; two streams, which the L2 prefetcher runs
 * ahead of each on its own, 46-48 ms (four 46, eight 47). The decoder chooses (cpu_kernels.py,
 * `dense_streams`). */
void hr_dense(const float *x, int64_t m, int64_t k, const float *packed, int64_t n, const float *bias, float *out,
              int streams, int nthreads) {
    int64_t panels = (n + HR_NR - 1) / HR_NR;
    int64_t shift = streams >= 4 ? 2 : streams >= 2 ? 1 : 0, ways = (int64_t)1 << shift;
#pragma omp parallel num_threads(nthreads)
    {
        int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t p0 = panels * t / nt, p1 = panels * (t + 1) / nt;
        int64_t run = (p1 - p0 + ways - 1) / ways; /* panels per stream: stream s has p0 + s run .. */
        float acc[HR_MAX_STREAMS][HR_TILES * 3 * HR_MR * 16] __attribute__((aligned(64)));
        for (int64_t r0 = 0; r0 < m; r0 += HR_TILES * HR_MR) {
            int64_t rows = m - r0 < HR_TILES * HR_MR ? m - r0 : HR_TILES * HR_MR;
            int64_t tiles = (rows + HR_MR - 1) / HR_MR;
            const float *xr[HR_TILES * HR_MR];
            for (int64_t r = 0; r < tiles * HR_MR; r++) xr[r] = x + (r0 + (r < rows ? r : rows - 1)) * k;
            /* Few tiles leave the arithmetic short of the reads: short chunks keep the stream steady.
             * From four tiles on each chunk is compute-bound, and longer ones halve the passes' fixed
             * cost (25M shapes, 48-64 rows, one thread: 5-8% faster at 128 than at 64; SmolLM2's
             * layer products at 32 rows, two threads, a Zen 4: 165 -> 175 GFLOP/s, AVX2 build 150 ->
             * 154; at 8-24 rows no gain). */
            int64_t chunk = tiles > 3 ? 2 * HR_KC : HR_KC;
            for (int64_t i = 0; i < run; i++) {
                /* the streams' i-th panels; the live ones are a prefix (only the last runs fall short) */
                int64_t ps[HR_MAX_STREAMS];
                int live = 0, vecs[HR_MAX_STREAMS]; /* vecs: each panel's 8-column vectors with real columns */
                for (int s = 0; s < ways; s++)
                    if ((ps[s] = p0 + s * run + i) < p1) {
                        live = s + 1;
                        vecs[s] = n - ps[s] * HR_NR >= HR_NR ? HR_NR / 8 : (int)(n - ps[s] * HR_NR + 7) / 8;
                    }
                for (int64_t kc = 0; kc < k; kc += chunk) {
                    int64_t len = k - kc < chunk ? k - kc : chunk, next = 0;
                    /* the chunks read next: each stream's following one, or its next panel's first */
                    hr_ahead ahead = {.mask = ways - 1, .shift = shift};
                    int known = 0;
                    if (kc + len < k) {
                        next = k - kc - len < chunk ? k - kc - len : chunk;
                        for (int s = 0; s < live; s++) ahead.at[known++] = (const char *)(packed + (ps[s] * k + kc + len) * HR_NR);
                    } else if (i + 1 < run) {
                        next = k < chunk ? k : chunk;
                        for (int s = 0; s < live; s++)
                            if (ps[s] + 1 < p1) ahead.at[known++] = (const char *)(packed + (ps[s] + 1) * k * HR_NR);
                    }
                    for (int s = known; s < ways; s++) ahead.at[s] = known ? ahead.at[s % known] : NULL; /* again: harmless */
                    int64_t lines = known ? ways * (next * HR_NR * 4 / 64) : 0, passes = len * tiles * live;
                    int64_t per4 = (4 * lines + passes - 1) / passes, done = 0;
                    for (int s = 0; s < live; s++) {
                        const float *panel = packed + ps[s] * k * HR_NR;
                        for (int64_t tile = 0; tile < tiles; tile++)
                            hr_tile(xr + tile * HR_MR, kc, panel + kc * HR_NR, len, acc[s] + tile * 3 * HR_MR * 16,
                                    kc == 0, &ahead, lines, per4, &done, vecs[s], tiles <= HR_L2_TILES);
                    }
                }
                for (int s = 0; s < live; s++) hr_store_panel(acc[s], ps[s], n, bias, out, r0, rows);
            }
        }
    }
}
#else
int hr_dense_supported(void) { return 0; }

/* Without AVX-512 or AVX2 the decoder keeps torch's GEMM (hr_dense_supported() == 0); never called. */
void hr_dense(const float *x, int64_t m, int64_t k, const float *packed, int64_t n, const float *bias, float *out,
              int streams, int nthreads) {
    (void)x, (void)m, (void)k, (void)packed, (void)n, (void)bias, (void)out, (void)streams, (void)nthreads;
}
#endif

/* ---------------------------------------------------------------------------------------------
 * A decode step's layers in one call. Called per layer from Python, the kernels above cost about
 * nine calls a layer (four products, the attention, three norms, the activation), each a few
 * microseconds of argument passing: 0.3 ms of a tiny-model step and 1.8 ms of a SmolLM2 one. With
 * packed weights (hr_dense, so AVX-512 or AVX2 builds) the decoder calls this once per step instead;
 * the arithmetic is the same calls in the same order, so the results are bit-identical.
 *
 * On entry `normed` holds layer 0's input norm of `hidden` (width rows, `embed` wide), on return the
 * final norm's; `hidden` is updated in place. Scratch: qkv (width, qkv_width), attn (width, heads d),
 * proj (width, embed), gate_up (width, 2 inter), act (width, inter). Per layer l:
 *   weights[8 l ..]  packed qkv, its bias, packed o, bias, packed gate_up, bias, packed down, bias
 *                    (a bias may be NULL);
 *   norms[2 l ..], eps[2 l ..]  the post-attention norm, then the next norm (the next layer's input
 *                    norm, or the final norm after the last layer);
 *   keys / values    cache + l layer_stride (+ kv_stride for the values), rows and heads at
 *                    row_stride / head_stride as in hr_decode_attention; likewise the shared
 *                    prompts' store (prompts NULL: none).
 * `rows` rows are live; the products run over `width` >= rows rows.
 * ------------------------------------------------------------------------------------------- */
void hr_decode_layers(float *hidden, float *normed, float *qkv, float *attn, float *proj, float *gate_up,
                      float *act, int64_t rows, int64_t width, int64_t layers, int64_t embed, int64_t qkv_width,
                      int64_t inter, const float *const *weights, const float *const *norms, const float *eps,
                      void *cache, int64_t layer_stride, int64_t kv_stride, int64_t row_stride,
                      int64_t head_stride, const void *prompts, int64_t prompt_layer_stride,
                      int64_t prompt_kv_stride, int64_t prow_stride, int64_t phead_stride,
                      const int64_t *source, int64_t shared, const float *cos, const float *ssin,
                      const uint8_t *valid, int64_t valid_stride, int64_t slot, int64_t heads, int64_t kv_heads,
                      int64_t d, float scale, int half, int streams, int nthreads) {
    int64_t size = HR_KV_BYTES(half);
    for (int64_t l = 0; l < layers; l++) {
        const float *const *w = weights + 8 * l;
        char *keys = (char *)cache + l * layer_stride * size;
        const char *pkeys = prompts ? (const char *)prompts + l * prompt_layer_stride * size : NULL;
        hr_dense(normed, width, embed, w[0], qkv_width, w[1], qkv, streams, nthreads);
        hr_decode_attention(qkv, qkv_width, cos, ssin, keys, keys + kv_stride * size, row_stride, head_stride, valid,
                            valid_stride, slot, slot + 1, attn, rows, heads, kv_heads, d, scale, pkeys,
                            pkeys ? pkeys + prompt_kv_stride * size : NULL, prow_stride, phead_stride, source, shared,
                            half, nthreads);
        hr_dense(attn, width, heads * d, w[2], embed, w[3], proj, streams, nthreads);
        hr_add_rms_norm(hidden, proj, norms[2 * l], normed, rows, embed, eps[2 * l], nthreads);
        hr_dense(normed, width, embed, w[4], 2 * inter, w[5], gate_up, streams, nthreads);
        hr_silu_mul(gate_up, act, rows, inter, nthreads);
        hr_dense(act, width, inter, w[6], embed, w[7], proj, streams, nthreads);
        hr_add_rms_norm(hidden, proj, norms[2 * l + 1], normed, rows, embed, eps[2 * l + 1], nthreads);
    }
}
