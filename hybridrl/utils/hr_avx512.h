/* AVX-512 helpers shared by hybridrl's C kernels (hybridrl/engine/cpu_attention.c,
 * hybridrl/rollout/cpu_kernels.c). Included by path from those files; hybridrl/utils/native_build.py
 * hashes included local headers with the source, so a change here rebuilds both. */
#ifndef HR_AVX512_H
#define HR_AVX512_H
#if defined(__AVX512F__)
#include <immintrin.h>
#include <stdint.h>

/* The first n of 16 lanes (n clamped to [0, 16]). */
static inline __mmask16 lanes(int64_t n) {
    return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
}

/* 16 x 16 transpose in registers: r[i] holds row i on entry, column i on return. */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
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

/* Rows [0, nr) x columns [0, nc) of a block at x (row stride xs) into r[16], zero elsewhere. */
static inline void load_block16(const float *x, int64_t xs, int64_t nr, int64_t nc, __m512 r[16]) {
    __mmask16 cm = lanes(nc);
    for (int64_t i = 0; i < 16; i++) r[i] = i < nr ? _mm512_maskz_loadu_ps(cm, x + i * xs) : _mm512_setzero_ps();
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
    __mmask16 rows_mask = lanes(nr);
    for (int64_t c0 = 0; c0 < cols; c0 += 16) {
        int64_t nc = cols - c0 < 16 ? cols - c0 : 16;
        for (int64_t i = 0; i < per && row < 16; i++) { /* a prefetch never faults, also past the end */
            _mm_prefetch((const char *)(next + row * xs) + line * 64, _MM_HINT_T0);
            if (++line == lines) line = 0, row++;
        }
        __m512 r[16];
        load_block16(x + c0, xs, nr, nc, r);
        transpose16(r);
        if (stream)
            for (int64_t i = 0; i < nc; i++) _mm512_stream_ps(dst + (c0 + i) * dst_stride, r[i]);
        else
            for (int64_t i = 0; i < nc; i++) _mm512_mask_storeu_ps(dst + (c0 + i) * dst_stride, rows_mask, r[i]);
    }
}
#endif
#endif
