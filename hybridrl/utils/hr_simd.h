/* 16-float vectors for hybridrl's C kernels (hybridrl/engine/cpu_attention.c,
 * hybridrl/rollout/cpu_kernels.c), on AVX-512 and on AVX2 with FMA.
 *
 * The kernels are written against one vector of 16 floats (`hv`) and a 16-bit lane mask (`hm`). With
 * AVX-512 they are one zmm register and one mask register, and every `hv_*` below is the intrinsic of
 * the same name. With AVX2 + FMA (most laptops, Intel client CPUs, AMD before Zen 4) a vector is a
 * pair of ymm registers and a mask a uint16_t, turned into lane masks where a load, store or blend
 * needs one; the arithmetic is the same operation on each half, in the same order (the horizontal sums
 * too, and exp's polynomial and scaling by 2^n). HR_SIMD is 512,
 * 256 or 0 (neither: the kernels report themselves unsupported and torch's ops are used).
 *
 * Included by path from those files; hybridrl/utils/native_build.py hashes included local headers
 * with the source, so a change here rebuilds both. */
#ifndef HR_SIMD_H
#define HR_SIMD_H
#include <stdint.h>

#if defined(__AVX512F__)
#define HR_SIMD 512
#elif defined(__AVX2__) && defined(__FMA__)
#define HR_SIMD 256
#else
#define HR_SIMD 0
#endif

#if HR_SIMD
#include <immintrin.h>
#endif

#if HR_SIMD == 512
typedef __m512 hv;
typedef __mmask16 hm;
#define hv_zero _mm512_setzero_ps
#define hv_set1 _mm512_set1_ps
#define hv_loadu _mm512_loadu_ps
#define hv_storeu _mm512_storeu_ps
#define hv_stream _mm512_stream_ps /* 64-byte aligned */
#define hv_add _mm512_add_ps
#define hv_sub _mm512_sub_ps
#define hv_mul _mm512_mul_ps
#define hv_max _mm512_max_ps
#define hv_min _mm512_min_ps
#define hv_fmadd _mm512_fmadd_ps   /* a * b + c */
#define hv_fnmadd _mm512_fnmadd_ps /* c - a * b */
#define hv_maskz_loadu _mm512_maskz_loadu_ps
#define hv_mask_storeu _mm512_mask_storeu_ps
#define hv_maskz_mov _mm512_maskz_mov_ps
#define hv_mask_mul _mm512_mask_mul_ps /* (src, m, a, b): a * b in the lanes of m, src elsewhere */
#define hv_mask_max _mm512_mask_max_ps
#define hv_reduce_add _mm512_reduce_add_ps
#define hv_reduce_max _mm512_reduce_max_ps
static inline hm hv_cmp_neq(hv a, hv b) { return _mm512_cmp_ps_mask(a, b, _CMP_NEQ_OQ); }
static inline hv hv_round(hv x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

#elif HR_SIMD == 256
typedef struct {
    __m256 lo, hi; /* lanes 0-7, 8-15 */
} hv;
typedef uint16_t hm;

/* the 8 lanes of `bits` (bit i: lane i) as an all-ones / all-zeros integer vector */
static inline __m256i hr_mask8(unsigned bits) {
    const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)bits), sel), sel);
}
#define HR_PAIR(expr_lo, expr_hi) ((hv){expr_lo, expr_hi})
static inline hv hv_zero(void) { return HR_PAIR(_mm256_setzero_ps(), _mm256_setzero_ps()); }
static inline hv hv_set1(float x) { return HR_PAIR(_mm256_set1_ps(x), _mm256_set1_ps(x)); }
static inline hv hv_loadu(const float *p) { return HR_PAIR(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
static inline void hv_storeu(float *p, hv a) { _mm256_storeu_ps(p, a.lo), _mm256_storeu_ps(p + 8, a.hi); }
static inline void hv_stream(float *p, hv a) { _mm256_stream_ps(p, a.lo), _mm256_stream_ps(p + 8, a.hi); }
static inline hv hv_add(hv a, hv b) { return HR_PAIR(_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)); }
static inline hv hv_sub(hv a, hv b) { return HR_PAIR(_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)); }
static inline hv hv_mul(hv a, hv b) { return HR_PAIR(_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)); }
static inline hv hv_max(hv a, hv b) { return HR_PAIR(_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)); }
static inline hv hv_min(hv a, hv b) { return HR_PAIR(_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)); }
static inline hv hv_fmadd(hv a, hv b, hv c) {
    return HR_PAIR(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi));
}
static inline hv hv_fnmadd(hv a, hv b, hv c) {
    return HR_PAIR(_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi));
}
/* masked-off lanes are neither read nor written (no fault past the end of a buffer) */
static inline hv hv_maskz_loadu(hm m, const float *p) {
    return HR_PAIR(_mm256_maskload_ps(p, hr_mask8(m & 0xFF)), _mm256_maskload_ps(p + 8, hr_mask8(m >> 8)));
}
static inline void hv_mask_storeu(float *p, hm m, hv a) {
    _mm256_maskstore_ps(p, hr_mask8(m & 0xFF), a.lo), _mm256_maskstore_ps(p + 8, hr_mask8(m >> 8), a.hi);
}
static inline hv hv_maskz_mov(hm m, hv a) {
    return HR_PAIR(_mm256_and_ps(a.lo, _mm256_castsi256_ps(hr_mask8(m & 0xFF))),
                   _mm256_and_ps(a.hi, _mm256_castsi256_ps(hr_mask8(m >> 8))));
}
static inline hv hv_mask_mul(hv src, hm m, hv a, hv b) {
    return HR_PAIR(_mm256_blendv_ps(src.lo, _mm256_mul_ps(a.lo, b.lo), _mm256_castsi256_ps(hr_mask8(m & 0xFF))),
                   _mm256_blendv_ps(src.hi, _mm256_mul_ps(a.hi, b.hi), _mm256_castsi256_ps(hr_mask8(m >> 8))));
}
static inline hv hv_mask_max(hv src, hm m, hv a, hv b) {
    return HR_PAIR(_mm256_blendv_ps(src.lo, _mm256_max_ps(a.lo, b.lo), _mm256_castsi256_ps(hr_mask8(m & 0xFF))),
                   _mm256_blendv_ps(src.hi, _mm256_max_ps(a.hi, b.hi), _mm256_castsi256_ps(hr_mask8(m >> 8))));
}
/* the sums in AVX-512's order (halves, then quarters, ...), so both give the same float */
static inline float hv_reduce_add(hv a) {
    __m256 s = _mm256_add_ps(a.lo, a.hi);
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
}
static inline float hv_reduce_max(hv a) {
    __m256 s = _mm256_max_ps(a.lo, a.hi);
    __m128 q = _mm_max_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    q = _mm_max_ps(q, _mm_movehl_ps(q, q));
    q = _mm_max_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
}
static inline hm hv_cmp_neq(hv a, hv b) {
    return (hm)(_mm256_movemask_ps(_mm256_cmp_ps(a.lo, b.lo, _CMP_NEQ_OQ)) |
                _mm256_movemask_ps(_mm256_cmp_ps(a.hi, b.hi, _CMP_NEQ_OQ)) << 8);
}
static inline hv hv_round(hv x) {
    return HR_PAIR(_mm256_round_ps(x.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                   _mm256_round_ps(x.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
/* 2^k for integral k in [-126, 127], as float bits */
static inline __m256 hr_pow2(__m256i k) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k, _mm256_set1_epi32(127)), 23));
}
#endif

#if HR_SIMD
/* The first n of 16 lanes (n clamped to [0, 16]). */
static inline hm lanes(int64_t n) {
    return n >= 16 ? (hm)0xFFFF : n <= 0 ? (hm)0 : (hm)((1u << n) - 1);
}

/* a / b, correctly rounded. In asm: under -ffast-math GCC turns a vector division into a reciprocal
 * estimate and a Newton step (2 ulp; silu's gradient at g = 1e4 came out 6e-4 off). */
#if HR_SIMD == 512
static inline hv hv_div(hv a, hv b) {
    hv r;
    __asm__("vdivps %2, %1, %0" : "=v"(r) : "v"(a), "v"(b));
    return r;
}
#else
static inline __m256 hr_div8(__m256 a, __m256 b) {
    __m256 r;
    __asm__("vdivps %2, %1, %0" : "=x"(r) : "x"(a), "x"(b));
    return r;
}
static inline hv hv_div(hv a, hv b) { return HR_PAIR(hr_div8(a.lo, b.lo), hr_div8(a.hi, b.hi)); }
#endif

/* exp(min(x, 88)) (exp(88) = 1.7e38), x smaller than -87.3 giving 0, to about 1 ulp: 2^n times a
 * degree-7 polynomial of the remainder (Cephes' expf). The compiler's vectorised expf was a separate
 * call per 16 values. With x at most 88, n is at most 127, so 2^n is one float (AVX2: its bits; a
 * two-step scaling that also took n = 128, up to 88.7, was an eighth of the work: 1.43 -> 1.22 ns an
 * element on a Zen 1, the same floats below 88.3). */
static inline hv hv_exp_le88(hv x) {
    const hv lo = hv_set1(-87.33654f);
    hv y = hv_min(hv_max(x, lo), hv_set1(88.f));
    hv n = hv_round(hv_mul(y, hv_set1(1.44269504088896341f)));
    hv r = hv_fnmadd(n, hv_set1(0.693359375f), y);
    r = hv_fnmadd(n, hv_set1(-2.12194440e-4f), r);
    hv q = hv_set1(1.9875691500e-4f);
    q = hv_fmadd(q, r, hv_set1(1.3981999507e-3f));
    q = hv_fmadd(q, r, hv_set1(8.3334519073e-3f));
    q = hv_fmadd(q, r, hv_set1(4.1665795894e-2f));
    q = hv_fmadd(q, r, hv_set1(1.6666665459e-1f));
    q = hv_fmadd(q, r, hv_set1(5.0000001201e-1f));
    q = hv_fmadd(q, hv_mul(r, r), hv_add(r, hv_set1(1.f)));
#if HR_SIMD == 512
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ), _mm512_scalef_ps(q, n));
#else
    __m256 a = _mm256_mul_ps(q.lo, hr_pow2(_mm256_cvtps_epi32(n.lo)));
    __m256 b = _mm256_mul_ps(q.hi, hr_pow2(_mm256_cvtps_epi32(n.hi)));
    return HR_PAIR(_mm256_and_ps(a, _mm256_cmp_ps(x.lo, lo.lo, _CMP_GE_OQ)),
                   _mm256_and_ps(b, _mm256_cmp_ps(x.hi, lo.hi, _CMP_GE_OQ)));
#endif
}

/* exp(x[i] - top) for i < n into out (NULL: not kept; with `stream`, streaming stores, which need out
 * 64-byte aligned and n a multiple of 16), and their sum, added in one order for every caller: the
 * update's token log-probs, and the rollout's softmax and sampler (whose block sums and a block's
 * weights must add up the same values). With `dot` (not NULL), also the sum of exp(x[i] - top) (x[i] -
 * top) into it (the entropy's numerator); the exponentials' sum is unchanged by it. */
static inline float hv_exp_sum_dot(const float *x, float top, int64_t n, float *out, int stream, float *dot) {
    hv sum = hv_zero(), acc = hv_zero(), m = hv_set1(top);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        hv z = hv_sub(hv_loadu(x + i), m);
        hv e = hv_exp_le88(z);
        if (stream)
            hv_stream(out + i, e);
        else if (out)
            hv_storeu(out + i, e);
        sum = hv_add(sum, e);
        if (dot) acc = hv_add(acc, hv_mul(e, z));
    }
    if (i < n) {
        hm lane = lanes(n - i);
        hv z = hv_sub(hv_maskz_loadu(lane, x + i), m);
        hv e = hv_maskz_mov(lane, hv_exp_le88(z));
        if (out) hv_mask_storeu(out + i, lane, e);
        sum = hv_add(sum, e);
        if (dot) acc = hv_add(acc, hv_maskz_mov(lane, hv_mul(e, z)));
    }
    if (dot) *dot = hv_reduce_add(acc);
    return hv_reduce_add(sum);
}

/* the same with no dot: every caller's sums are this one loop's */
static inline float hv_exp_sum(const float *x, float top, int64_t n, float *out, int stream) {
    return hv_exp_sum_dot(x, top, n, out, stream, NULL);
}

/* exp(-g) clamped at exp(88): silu(g) for g < -88 is below 1e-36 either way */
static inline hv hv_exp_neg(hv g) { return hv_exp_le88(hv_sub(hv_zero(), g)); }

/* silu(g) u = g u / (1 + exp(-g)): the update's SwiGLU (cpu_attention.c) and the rollout's decode step
 * (cpu_kernels.c) compute it with these same instructions, so both give the same floats */
static inline hv hv_swiglu(hv g, hv u) { return hv_div(hv_mul(g, u), hv_add(hv_set1(1.f), hv_exp_neg(g))); }

/* h[j] = silu(g[j]) u[j] for j < cols, values j .. j + 15 (j a multiple of 16) at g + (j / 16) step and
 * u likewise: step 16 reads contiguous values, 32 the update's interleaved gate-up rows. `stream`:
 * written with streaming stores (h on a cache line, cols a multiple of 16; the caller fences). */
static inline void hv_swiglu_row(const float *g, const float *u, int64_t step, float *h, int64_t cols, int stream) {
    int64_t j = 0, at = 0;
    for (; j + 16 <= cols; j += 16, at += step) {
        hv x = hv_swiglu(hv_loadu(g + at), hv_loadu(u + at));
        if (stream)
            hv_stream(h + j, x);
        else
            hv_storeu(h + j, x);
    }
    if (j < cols) {
        hm m = lanes(cols - j);
        hv_mask_storeu(h + j, m, hv_swiglu(hv_maskz_loadu(m, g + at), hv_maskz_loadu(m, u + at)));
    }
}

/* 16 x 16 transpose in registers: r[i] holds row i on entry, column i on return. */
#if HR_SIMD == 512
static inline void transpose16(hv r[16]) {
    hv t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
    }
}
#else
/* 8 x 8 in ymm registers: r[i] row i on entry, column i on return */
static inline void hr_transpose8(__m256 r[8]) {
    __m256 t[8], s[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        s[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        s[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        s[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        s[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x31);
    }
}
/* the four 8 x 8 quarters transposed, the off-diagonal ones swapped */
static inline void transpose16(hv r[16]) {
    __m256 a[8], b[8], c[8], d[8]; /* rows 0-7 left / right, rows 8-15 left / right */
    for (int i = 0; i < 8; i++) a[i] = r[i].lo, b[i] = r[i].hi, c[i] = r[i + 8].lo, d[i] = r[i + 8].hi;
    hr_transpose8(a), hr_transpose8(b), hr_transpose8(c), hr_transpose8(d);
    for (int i = 0; i < 8; i++) r[i] = HR_PAIR(a[i], c[i]), r[i + 8] = HR_PAIR(b[i], d[i]);
}
#endif

/* Rows [0, nr) x columns [0, nc) of a block at x (row stride xs) into r[16], zero elsewhere. */
static inline void load_block16(const float *x, int64_t xs, int64_t nr, int64_t nc, hv r[16]) {
    hm cm = lanes(nc);
    for (int64_t i = 0; i < 16; i++) r[i] = i < nr ? hv_maskz_loadu(cm, x + i * xs) : hv_zero();
}

/* Rows [0, nr) (nr <= 16) of x (row stride xs), `cols` wide, transposed 16 x 16 in registers:
 * column c goes to dst + c * dst_stride as 16 floats, lane i from row i, lanes past nr left as they
 * are; or, with `stream` (nr 16, dst and dst_stride whole 64-byte lines; the caller ends with
 * _mm_sfence), as whole lines by streaming stores: each store of a block lands on another line,
 * which a plain store would read first. While these rows are transposed the 16 rows at `next` (row
 * stride xs; NULL: none) are requested, `per` lines per 16 columns: 16 row streams at once are more
 * than the hardware prefetcher keeps ahead of (the decode weights' packing 53 -> 25 ms for SmolLM2, a
 * (8288, 384) transpose 1.5 -> 0.6 ms). */
static inline void transpose_rows16(const float *x, int64_t xs, int64_t nr, int64_t cols, const float *next,
                                    int64_t per, float *dst, int64_t dst_stride, int stream) {
    int64_t lines = (cols * 4 + 63) / 64, row = next ? 0 : 16, line = 0;
    hm rows_mask = lanes(nr);
    for (int64_t c0 = 0; c0 < cols; c0 += 16) {
        int64_t nc = cols - c0 < 16 ? cols - c0 : 16;
        for (int64_t i = 0; i < per && row < 16; i++) { /* a prefetch never faults, also past the end */
            _mm_prefetch((const char *)(next + row * xs) + line * 64, _MM_HINT_T0);
            if (++line == lines) line = 0, row++;
        }
        hv r[16];
        load_block16(x + c0, xs, nr, nc, r);
        transpose16(r);
        if (stream)
            for (int64_t i = 0; i < nc; i++) hv_stream(dst + (c0 + i) * dst_stride, r[i]);
        else
            for (int64_t i = 0; i < nc; i++) hv_mask_storeu(dst + (c0 + i) * dst_stride, rows_mask, r[i]);
    }
}
#endif /* HR_SIMD */
#endif /* HR_SIMD_H */
