/* Attention for training on CPU in fp32: forward (saving each query's log-sum-exp) and backward.
 *
 * torch's CPU attention (scaled_dot_product_attention) runs its small per-head products through
 * the BLAS sgemm, which on AMD processors is MKL's AVX2 code at about half of what the machine can
 * do, and with an explicit mask it visits every key of every query. Here the products are
 * register-blocked loops over RB queries at a time (16-float vectors, hybridrl/utils/hr_simd.h:
 * AVX-512, or AVX2 + FMA as pairs of ymm registers), and each block of queries visits only
 * the keys between the first and the last one its mask allows (causal attention skips the upper
 * triangle, left padding its columns). At the short sequences of RL training (tens of keys) the
 * work around the products weighs as much as they do, so it is vectorised too: each mask row's key
 * range is found once per call, the softmax reads 16 mask bytes per step and computes its own exp,
 * keys are transposed 16 x 16 in registers, and the backward's per-query dot(dO, O) is one pass
 * over both tensors before the blocks. Built at run time by hybridrl/engine/cpu_attention.py (see
 * hybridrl/utils/native_build.py); without AVX-512 or AVX2, hr_attention_supported() is 0 and
 * torch's attention is used.
 *
 * Shapes (float32; strides in elements, the last dimension always contiguous):
 *   q            (B, H, T, D)     strides qsb, qsh, qst
 *   k, v         (B, KVH, S - P, D) strides ksb, ksh, kst and vsb, vsh, vst: each row's own keys
 *   kp, vp       (U, KVH, P, D)   strides kpsb, kpsh, kpst and vpsb, vpsh, vpst: keys shared by rows, row b reading
 *                                 kp[pidx[b]] as its keys 0 .. P - 1 and its own as P .. S - 1 (a
 *                                 group's prompt, hybridrl/engine/shared_prefix.py); P = 0: none
 *   mask         (B, T, S) bytes  strides msb (0: shared by all rows), mst; nonzero = may attend
 *   out, dout    (B, T, H, D)     contiguous (the layout the output projection reads)
 *   lse          (B, H, T)        contiguous: log sum_j exp(scale q.k_j) over allowed keys
 *   dq           (B, H, T, D)     strides dqsb, dqsh, dqst; dk, dv (B, KVH, S - P, D) strides
 *                                 dksb, dksh, dkst (both alike); dkp, dvp (U, KVH, P, D) strides
 *                                 dkpsb, dkpsh, dkpst (both alike): the shared keys' gradients, to
 *                                 which every row's is added, in row order (whatever the threads)
 * Query head h reads key/value head h / (H / KVH). A query that may attend to no key gets a zero
 * output and zero gradients. D must be a multiple of 16 and at most 256.
 */

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../utils/hr_simd.h" /* hv, hm, lanes, hv_exp_le88, hv_exp_sum, hv_swiglu, transpose16, ... */

/* The vector code this build runs: 512 (AVX-512), 256 (AVX2 + FMA) or 0 (none: unsupported). */
int hr_simd(void) { return HR_SIMD; }

#if HR_SIMD

/* Queries per block, and whether the products also run 32 keys / columns at a time: the
 * accumulators of a block (RB x 2 vectors wide, RB x 1 narrow) and the operands must fit in the
 * registers. AVX-512 has 32 (8 x 2 accumulators); AVX2 16 ymm, a vector being two of them, so 6 x 1
 * (12 + 2 operand + 1 broadcast). At the tiny model's shapes (128 rows, 79 keys, head size 32, one
 * thread, a Zen 3) the forward took 8.5 ms so, 14.6 at 8 x 2 (spilling) and 9.2 at 4 x 1. */
#if HR_SIMD == 512
#define RB 8
#define HR_WIDE 1
#else
#define RB 6
#define HR_WIDE 0
#endif
#define NEG -3.0e38f

int hr_attention_supported(void) { return 1; }

typedef struct {
    const float *q, *k, *v;
    int64_t qsb, qsh, qst, ksb, ksh, kst, vsb, vsh, vst;
    const float *kp, *vp;            /* shared keys (P of them) */
    int64_t kpsb, kpsh, kpst, vpsb, vpsh, vpst, P;
    const int64_t *pidx;
    const uint8_t *mask;
    int64_t msb, mst;
    int64_t B, H, KVH, T, S, D;
    float scale;
    float *out, *lse;                /* forward: written; backward: read */
    const float *dout;               /* backward only */
    float *dq, *dk, *dv, *dkp, *dvp; /* backward only */
    int64_t dqsb, dqsh, dqst, dksb, dksh, dkst, dkpsb, dkpsh, dkpst;
    float *row_shared;               /* backward with P: (B, KVH, 2, P, D) each row's shared-key gradients */
    int32_t *range;                  /* (B' or 1, T, 2): first and one-past-last allowed key of a mask row */
    float *delta;                    /* backward: (B, T, H) sum_c dout * out of each query */
} hr_att;

static int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* Row length of the transposed keys and score buffers: whole 32-key steps plus 16, so that rows are an
 * odd number of cache lines apart (a power-of-two stride put all of a step's rows in two L1 sets). */
static int64_t padded(int64_t S) { return round_up(S, 32) + 16; }

/* kt (D, Sp) = transpose of rows [0, S) of x (S, D) with row stride xs; zero past S. In 16 x 16
 * blocks through registers (element by element, the strided stores took a sixth of the forward).
 * Rows [0, P) may come from elsewhere: row j < P is x0 + j * xs0 (a row's shared prompt keys, read
 * in place; P = 0: none). */
static void transpose_keys(const float *x0, int64_t xs0, int64_t P, const float *x, int64_t xs, int64_t S,
                           int64_t Sp, int64_t D, float *kt) {
    int64_t S16 = round_up(S, 16);
    for (int64_t j0 = 0; j0 < S16; j0 += 16)
        for (int64_t c0 = 0; c0 < D; c0 += 16) {
            hv r[16];
            for (int64_t i = 0, j = j0; i < 16; i++, j++)
                r[i] = j >= S ? hv_zero() : hv_loadu((j < P ? x0 + j * xs0 : x + (j - P) * xs) + c0);
            transpose16(r);
            for (int64_t i = 0; i < 16; i++) hv_storeu(kt + (c0 + i) * Sp + j0, r[i]);
        }
    for (int64_t c = 0; c < D; c++) memset(kt + c * Sp + S16, 0, (Sp - S16) * sizeof(float));
}

/* s[r][j] = rows[r] . kt[:, j] for j in [j0, j1) (j0, j1 multiples of 16, j1 <= Sp); s rows Sp apart */
static void row_dots(const float *const *rows, const float *kt, int64_t Sp, int64_t D, int64_t j0, int64_t j1,
                     float *s) {
    int64_t j = j0;
    for (; HR_WIDE && j + 32 <= j1; j += 32) {
        hv a[RB][2];
        for (int r = 0; r < RB; r++) a[r][0] = a[r][1] = hv_zero();
        for (int64_t c = 0; c < D; c++) {
            hv k0 = hv_loadu(kt + c * Sp + j), k1 = hv_loadu(kt + c * Sp + j + 16);
            for (int r = 0; r < RB; r++) {
                hv b = hv_set1(rows[r][c]);
                a[r][0] = hv_fmadd(b, k0, a[r][0]);
                a[r][1] = hv_fmadd(b, k1, a[r][1]);
            }
        }
        for (int r = 0; r < RB; r++) {
            hv_storeu(s + r * Sp + j, a[r][0]);
            hv_storeu(s + r * Sp + j + 16, a[r][1]);
        }
    }
    for (; j < j1; j += 16) {
        hv a[RB];
        for (int r = 0; r < RB; r++) a[r] = hv_zero();
        for (int64_t c = 0; c < D; c++) {
            hv k0 = hv_loadu(kt + c * Sp + j);
            for (int r = 0; r < RB; r++) a[r] = hv_fmadd(hv_set1(rows[r][c]), k0, a[r]);
        }
        for (int r = 0; r < RB; r++) hv_storeu(s + r * Sp + j, a[r]);
    }
}

/* out[r][:] = f[r] sum_{j in [j0, j1)} w[r][j] * x[j][:] for D columns, x rows xs apart, w rows Sp
 * apart, f[r] = 1 without f. Columns in pairs of 16-float vectors (16 accumulators), a single one at
 * the end. */
static void weighted_rows(const float *w, int64_t Sp, const float *x, int64_t xs, int64_t D, int64_t j0, int64_t j1,
                          const float *f, float *const *out) {
    int64_t c = 0;
    for (; HR_WIDE && c + 32 <= D; c += 32) {
        hv a[RB][2];
        for (int r = 0; r < RB; r++) a[r][0] = a[r][1] = hv_zero();
        for (int64_t j = j0; j < j1; j++) {
            const float *xr = x + j * xs + c;
            hv x0 = hv_loadu(xr), x1 = hv_loadu(xr + 16);
            for (int r = 0; r < RB; r++) {
                hv b = hv_set1(w[r * Sp + j]);
                a[r][0] = hv_fmadd(b, x0, a[r][0]);
                a[r][1] = hv_fmadd(b, x1, a[r][1]);
            }
        }
        for (int r = 0; r < RB; r++) {
            hv fr = hv_set1(f ? f[r] : 1.f);
            hv_storeu(out[r] + c, hv_mul(a[r][0], fr));
            hv_storeu(out[r] + c + 16, hv_mul(a[r][1], fr));
        }
    }
    for (; c < D; c += 16) {
        hv a[RB];
        for (int r = 0; r < RB; r++) a[r] = hv_zero();
        for (int64_t j = j0; j < j1; j++) {
            hv x0 = hv_loadu(x + j * xs + c);
            for (int r = 0; r < RB; r++) a[r] = hv_fmadd(hv_set1(w[r * Sp + j]), x0, a[r]);
        }
        for (int r = 0; r < RB; r++) hv_storeu(out[r] + c, hv_mul(a[r], hv_set1(f ? f[r] : 1.f)));
    }
}

/* acc[j][:] += sum_r w[r][j] * rows[r][:] for j in [j0, j1), acc (S, D) contiguous (rank-RB update) */
static void add_outer(const float *w, int64_t Sp, const float *const *rows, int64_t D, int64_t j0, int64_t j1,
                      float *acc) {
    int64_t c = 0;
    for (; HR_WIDE && c + 32 <= D; c += 32) {
        hv x[RB][2];
        for (int r = 0; r < RB; r++) x[r][0] = hv_loadu(rows[r] + c), x[r][1] = hv_loadu(rows[r] + c + 16);
        for (int64_t j = j0; j < j1; j++) {
            float *ar = acc + j * D + c;
            hv a0 = hv_loadu(ar), a1 = hv_loadu(ar + 16);
            for (int r = 0; r < RB; r++) {
                hv b = hv_set1(w[r * Sp + j]);
                a0 = hv_fmadd(b, x[r][0], a0);
                a1 = hv_fmadd(b, x[r][1], a1);
            }
            hv_storeu(ar, a0);
            hv_storeu(ar + 16, a1);
        }
    }
    for (; c < D; c += 16) {
        hv x[RB];
        for (int r = 0; r < RB; r++) x[r] = hv_loadu(rows[r] + c);
        for (int64_t j = j0; j < j1; j++) {
            float *ar = acc + j * D + c;
            hv a0 = hv_loadu(ar);
            for (int r = 0; r < RB; r++) a0 = hv_fmadd(hv_set1(w[r * Sp + j]), x[r], a0);
            hv_storeu(ar, a0);
        }
    }
}

/* Lanes of keys [j, j + 16) that mask row m allows, none at or past `end`. */
static inline hm allowed16(const uint8_t *m, int64_t j, int64_t end) {
    hm in = lanes(end - j);
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    __m128i v = _mm_maskz_loadu_epi8(in, m + j);
    return _mm_test_epi8_mask(v, v);
#else
    if (in == 0xFFFF) { /* 16 whole bytes: the lanes that are not zero */
        __m128i v = _mm_loadu_si128((const __m128i *)(m + j));
        return (hm)~_mm_movemask_epi8(_mm_cmpeq_epi8(v, _mm_setzero_si128()));
    }
    unsigned bits = 0;
    for (int i = 0; i < 16; i++) bits |= (unsigned)((in >> i) & 1 && m[j + i] != 0) << i;
    return (hm)bits;
#endif
}

/* first / one-past-last allowed key of a mask row, 16 mask bytes a step from each end; first >=
 * last when it allows none */
static void scan_row(const uint8_t *m, int64_t S, int32_t *out) {
    int64_t first = 0, last = S;
    for (; first < S; first += 16) {
        unsigned bits = allowed16(m, first, S);
        if (bits) {
            first += __builtin_ctz(bits);
            break;
        }
    }
    if (first > S) first = S;
    while (last > first) {
        int64_t lo = last - 16 > first ? last - 16 : first;
        unsigned bits = allowed16(m, lo, last);
        if (bits) {
            last = lo + 32 - __builtin_clz(bits);
            break;
        }
        last = lo;
    }
    out[0] = (int32_t)first, out[1] = (int32_t)last;
}

/* The allowed key range of every mask row, once per call (the blocks of every head read it). */
static void scan_mask(hr_att *a, int nthreads) {
    int64_t rows = (a->msb ? a->B : 1) * a->T;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t i = 0; i < rows; i++) scan_row(a->mask + (i / a->T) * a->msb + (i % a->T) * a->mst, a->S, a->range + 2 * i);
}

/* Keys [*j0, *j1) that some of the block's rows may attend to, widened to multiples of 16 for the
 * dot products (the mask is applied per key afterwards); 0 when no row may attend to any key. */
static int key_range(const hr_att *a, int64_t b, int64_t t0, int64_t rows, int64_t Sp, int64_t *j0, int64_t *j1) {
    int64_t lo = a->S, hi = 0;
    const int32_t *rg = a->range + 2 * ((a->msb ? b : 0) * a->T + t0);
    for (int64_t r = 0; r < rows; r++) {
        if (rg[2 * r] < rg[2 * r + 1]) {
            if (rg[2 * r] < lo) lo = rg[2 * r];
            if (rg[2 * r + 1] > hi) hi = rg[2 * r + 1];
        }
    }
    if (lo >= hi) return 0;
    *j0 = lo / 16 * 16;
    *j1 = round_up(hi, 16) < Sp ? round_up(hi, 16) : Sp;
    return 1;
}

/* p[r][j] = exp(scale s[r][j] - lse) over allowed keys in [j0, j1), 0 elsewhere in that range and in
 * rows past `rows`. With lse NULL the row's own log-sum-exp is computed and written to lse_out[r]
 * (0 for a row with no allowed key), p is left unnormalised, exp(scale s - max), and the factor that
 * normalises it written to inv[r] (0 for a row with no allowed key and past `rows`): the forward
 * scales its D outputs of a row instead of the row's keys. j0 and j1 are multiples of 16. */
static void softmax_rows(const hr_att *a, int64_t b, int64_t t0, int64_t rows, float *p, int64_t Sp, int64_t j0,
                         int64_t j1, const float *lse_in, float *lse_out, float *inv) {
    const hv scale = hv_set1(a->scale), neg = hv_set1(NEG);
    const uint8_t *mrow = a->mask + b * a->msb + t0 * a->mst;
    for (int64_t r = rows; r < RB; r++) {
        memset(p + r * Sp + j0, 0, (j1 - j0) * sizeof(float));
        if (inv) inv[r] = 0.f;
    }
    if (lse_in) {
        for (int64_t r = 0; r < rows; r++) {
            float *pr = p + r * Sp;
            const uint8_t *m = mrow + r * a->mst;
            hv l = hv_set1(lse_in[r]);
            for (int64_t j = j0; j < j1; j += 16) {
                hv x = hv_sub(hv_mul(hv_loadu(pr + j), scale), l);
                hv_storeu(pr + j, hv_maskz_mov(allowed16(m, j, a->S), hv_exp_le88(x)));
            }
        }
        return;
    }
    /* Each step over all rows before the next: a row alone is one chain of dependent steps (its
     * maximum, the exponentials after it, their sum, its logarithm), which left the core waiting
     * (0.65 of a 1.9 ms forward at the tiny model's shapes); the rows' chains are independent. */
    hv top[RB], total[RB];
    float mx[RB];
    for (int64_t r = 0; r < rows; r++) {
        float *pr = p + r * Sp;
        const uint8_t *m = mrow + r * a->mst;
        top[r] = neg;
        for (int64_t j = j0; j < j1; j += 16) {
            hv x = hv_mask_mul(neg, allowed16(m, j, a->S), hv_loadu(pr + j), scale);
            top[r] = hv_max(top[r], x);
            hv_storeu(pr + j, x);
        }
    }
    for (int64_t r = 0; r < rows; r++) mx[r] = hv_reduce_max(top[r]);
    for (int64_t r = 0; r < rows; r++) {
        float *pr = p + r * Sp;
        total[r] = hv_zero();
        if (mx[r] == NEG) { /* no allowed key */
            memset(pr + j0, 0, (j1 - j0) * sizeof(float));
            continue;
        }
        hv vmx = hv_set1(mx[r]);
        for (int64_t j = j0; j < j1; j += 16) {
            hv x = hv_loadu(pr + j);
            hv e = hv_maskz_mov(hv_cmp_neq(x, neg), hv_exp_le88(hv_sub(x, vmx)));
            total[r] = hv_add(total[r], e);
            hv_storeu(pr + j, e);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        if (mx[r] == NEG) {
            lse_out[r] = 0.f, inv[r] = 0.f;
            continue;
        }
        float sum = hv_reduce_add(total[r]);
        inv[r] = 1.f / sum;
        lse_out[r] = mx[r] + logf(sum);
    }
}

typedef struct {
    float *kt, *vt, *p, *dp, *dk, *dv, *kc, *vc;
} hr_scratch;

static hr_scratch *scratch_new(int64_t Sp, int64_t S, int64_t D, int backward) {
    hr_scratch *s = aligned_alloc(64, round_up(sizeof(hr_scratch), 64));
    if (!s) return NULL;
    int64_t floats = 2 * S * D + D * Sp + RB * Sp + (backward ? D * Sp + RB * Sp + 2 * S * D : 0);
    float *buf = aligned_alloc(64, round_up(floats * sizeof(float), 64));
    if (!buf) {
        free(s);
        return NULL;
    }
    s->kc = buf;
    s->vc = s->kc + S * D;
    s->kt = s->vc + S * D;
    s->p = s->kt + D * Sp;
    s->vt = backward ? s->p + RB * Sp : NULL;
    s->dp = backward ? s->vt + D * Sp : NULL;
    s->dk = backward ? s->dp + RB * Sp : NULL;
    s->dv = backward ? s->dk + S * D : NULL;
    return s;
}

static void scratch_free(hr_scratch *s) {
    if (s) free(s->kc), free(s);
}

/* rows [0, n) of x (row stride xs) to dst (row stride ds), D floats each */
static void copy_rows(const float *x, int64_t xs, int64_t n, int64_t D, float *dst, int64_t ds) {
    for (int64_t j = 0; j < n; j++)
        for (int64_t c = 0; c < D; c += 16) hv_storeu(dst + j * ds + c, hv_loadu(x + j * xs + c));
}

/* The values of one (row, kv head), S rows of D floats, contiguous in vc: the shared ones (vp of the
 * row's group) first, then the row's own. One pass over them in memory; the blocks then read them
 * from the cache, rows D floats apart rather than KVH D. */
static void gather_values(const hr_att *a, int64_t b, int64_t kh, float *vc) {
    int64_t D = a->D, P = a->P;
    if (P) copy_rows(a->vp + a->pidx[b] * a->vpsb + kh * a->vpsh, a->vpst, P, D, vc, D);
    copy_rows(a->v + b * a->vsb + kh * a->vsh, a->vst, a->S - P, D, vc + P * D, D);
}

/* gather_values, and the keys likewise into kc (the backward reads both per block). */
static void gather_kv(const hr_att *a, int64_t b, int64_t kh, float *kc, float *vc) {
    int64_t D = a->D, P = a->P;
    if (P) copy_rows(a->kp + a->pidx[b] * a->kpsb + kh * a->kpsh, a->kpst, P, D, kc, D);
    copy_rows(a->k + b * a->ksb + kh * a->ksh, a->kst, a->S - P, D, kc + P * D, D);
    gather_values(a, b, kh, vc);
}

/* How a request asks for its lines: into L1 or L2 to be read, or (`prefetchw` where the CPU has it)
 * owned, to be written: a block's output rows are st apart, a stream the hardware prefetcher does not
 * follow, and each of their first stores otherwise waits for its line to be read from memory. */
enum { FOR_L1, FOR_L2, FOR_WRITE };

/* Requests the n rows of x that are st apart, D floats each, as `how` says.
 *
 * Inlined always, as are its callers: GCC counts a prefetch as free of side effects, so a function
 * that only prefetches is pure to it and a call to one is dropped as dead code. Until 2026-12-06
 * prefetch_next_block was such a call, and the library held none of its requests
 * (tests/engine/test_cpu_attention.py checks the built library for them). */
static inline __attribute__((always_inline)) void request_rows(const float *x, int64_t st, int64_t n, int64_t D,
                                                               const int how) {
    for (int64_t t = 0; t < n; t++)
        for (int64_t c = 0; c < D; c += 16) {
            const char *p = (const char *)(x + t * st + c);
            if (how == FOR_WRITE)
                __builtin_prefetch(p, 1, 3);
            else if (how == FOR_L2)
                _mm_prefetch(p, _MM_HINT_T1);
            else
                _mm_prefetch(p, _MM_HINT_T0);
        }
}

/* Requests the rows of x (queries, the output's gradient, or the output the block writes) of the
 * block after (t0, h): the next RB positions of this head, else the first of the next head of the
 * same kv head. A block's rows are st apart, which the hardware prefetcher does not follow. Queries
 * into L1 (the backward) or L2 (the forward, whose blocks the L1 requests slowed: 5.6-5.9 against
 * 5.1-5.2 ms at the tiny model's shapes). At the tiny model's shapes (4 / 2 heads of 32, one thread,
 * medians of 31 calls alternating in one process, three rounds) the read requests take the backward
 * from 9.67-10.05 to 9.02-9.37 ms and the forward from 4.83-5.13 to 4.63-4.87; with the cache flushed
 * between calls, as in an update, the write requests then take them from 8.45-8.62 to 7.92-8.00 and
 * from 4.52-4.56 to 4.27-4.28 (first quartiles). */
static inline __attribute__((always_inline)) void prefetch_next_block(const float *x, int64_t sb, int64_t sh,
        int64_t st, int64_t b, int64_t h, int64_t t0, int64_t T, int64_t h_end, int64_t D, const int how) {
    int64_t nt = t0 + RB < T ? t0 + RB : 0, nh = t0 + RB < T ? h : h + 1;
    if (nh < h_end) request_rows(x + b * sb + nh * sh + nt * st, st, T - nt < RB ? T - nt : RB, D, how);
}

/* Requests for writing the share of (row b, kv head kh)'s dK and dV output rows that falls to its
 * block (g, t0): the item writes them all at its end, and asking for a sixteenth of them per block
 * (at the tiny model's shapes) keeps those stores from waiting on memory (without the requests, the
 * copy-out was 2.47 M of the backward's 23.1 M counter cycles; with them, leaving it out altogether
 * saves nothing measurable). */
static inline __attribute__((always_inline)) void claim_kv_grads(const hr_att *a, int64_t b, int64_t kh, int64_t g,
                                                                 int64_t t0) {
    int64_t per_head = (a->T + RB - 1) / RB, blocks = per_head * (a->H / a->KVH), i = g * per_head + t0 / RB;
    int64_t n = a->S - a->P, r0 = i * n / blocks, r1 = (i + 1) * n / blocks, at = b * a->dksb + kh * a->dksh + r0 * a->dkst;
    request_rows(a->dk + at, a->dkst, r1 - r0, a->D, FOR_WRITE);
    request_rows(a->dv + at, a->dkst, r1 - r0, a->D, FOR_WRITE);
}

/* Requests into L2 the rows that (row, kv head) `item` reads from memory: its own keys and values,
 * which it gathers and transposes first, and in the backward its query heads' queries and output
 * gradients; asked for at the start of item - threads, the one before it on the same thread when
 * the threads take the items in turn (dynamic scheduling may hand it to another; a request never
 * faults). At the tiny model's shapes, one thread,
 * three rounds of 31 calls: forward 4.87-5.00 -> 4.63-4.72 ms, backward 9.06-9.58 -> 8.92-9.23;
 * two threads and 9 / 3 heads of 64 within their spread or 1-5% faster. */
static inline __attribute__((always_inline)) void request_item(const hr_att *a, int64_t item, int backward) {
    if (item >= a->B * a->KVH) return;
    int64_t b = item / a->KVH, kh = item % a->KVH, G = a->H / a->KVH, T = a->T, D = a->D;
    if (backward)
        for (int64_t g = 0; g < G; g++) {
            request_rows(a->q + b * a->qsb + (kh * G + g) * a->qsh, a->qst, T, D, FOR_L2);
            request_rows(a->dout + (b * T * a->H + kh * G + g) * D, a->H * D, T, D, FOR_L2);
        }
    request_rows(a->k + b * a->ksb + kh * a->ksh, a->kst, a->S - a->P, D, FOR_L2);
    request_rows(a->v + b * a->vsb + kh * a->vsh, a->vst, a->S - a->P, D, FOR_L2);
}

/* One (row, kv head): its query heads' outputs and log-sum-exps. The keys are transposed from where
 * they lie (only the values, read once per block of queries, are gathered). */
static void forward_item(const hr_att *a, hr_scratch *sc, int64_t b, int64_t kh) {
    int64_t G = a->H / a->KVH, Sp = padded(a->S), T = a->T, H = a->H, D = a->D, S = a->S, P = a->P;
    const float *kp = P ? a->kp + a->pidx[b] * a->kpsb + kh * a->kpsh : NULL;
    gather_values(a, b, kh, sc->vc);
    transpose_keys(kp, a->kpst, P, a->k + b * a->ksb + kh * a->ksh, a->kst, S, Sp, D, sc->kt);
    for (int64_t g = 0; g < G; g++) {
        int64_t h = kh * G + g;
        for (int64_t t0 = 0; t0 < T; t0 += RB) {
            int64_t rows = T - t0 < RB ? T - t0 : RB, j0, j1;
            const float *qr[RB];
            float *orow[RB], discard[RB][256] __attribute__((aligned(64)));
            for (int r = 0; r < RB; r++) {
                int64_t t = r < rows ? t0 + r : t0 + rows - 1;
                qr[r] = a->q + b * a->qsb + h * a->qsh + t * a->qst;
                orow[r] = r < rows ? a->out + ((b * T + t) * H + h) * D : discard[r];
            }
            float *lrow = a->lse + (b * H + h) * T + t0, inv[RB];
            if (!key_range(a, b, t0, rows, Sp, &j0, &j1)) {
                for (int64_t r = 0; r < rows; r++) memset(orow[r], 0, D * sizeof(float)), lrow[r] = 0.f;
                continue;
            }
            prefetch_next_block(a->q, a->qsb, a->qsh, a->qst, b, h, t0, T, kh * G + G, D, FOR_L2);
            prefetch_next_block(a->out, T * H * D, D, H * D, b, h, t0, T, kh * G + G, D, FOR_WRITE);
            row_dots(qr, sc->kt, Sp, D, j0, j1, sc->p);
            softmax_rows(a, b, t0, rows, sc->p, Sp, j0, j1, NULL, lrow, inv);
            weighted_rows(sc->p, Sp, sc->vc, D, D, j0, j1 < S ? j1 : S, inv, orow);
        }
    }
}

/* One (row, kv head): dq of its query heads, dk and dv of the kv head (summed over those heads). */
static void backward_item(const hr_att *a, hr_scratch *sc, int64_t b, int64_t kh) {
    int64_t G = a->H / a->KVH, Sp = padded(a->S), T = a->T, H = a->H, D = a->D, S = a->S, P = a->P;
    gather_kv(a, b, kh, sc->kc, sc->vc);
    transpose_keys(NULL, 0, 0, sc->kc, D, S, Sp, D, sc->kt);
    transpose_keys(NULL, 0, 0, sc->vc, D, S, Sp, D, sc->vt);
    memset(sc->dk, 0, S * D * sizeof(float));
    memset(sc->dv, 0, S * D * sizeof(float));
    for (int64_t g = 0; g < G; g++) {
        int64_t h = kh * G + g;
        for (int64_t t0 = 0; t0 < T; t0 += RB) {
            int64_t rows = T - t0 < RB ? T - t0 : RB, j0, j1;
            const float *qr[RB], *dor[RB];
            float *dqr[RB], discard[RB][256] __attribute__((aligned(64))), delta[RB];
            prefetch_next_block(a->q, a->qsb, a->qsh, a->qst, b, h, t0, T, kh * G + G, D, FOR_L1);
            prefetch_next_block(a->dout, T * H * D, D, H * D, b, h, t0, T, kh * G + G, D, FOR_L1);
            prefetch_next_block(a->dq, a->dqsb, a->dqsh, a->dqst, b, h, t0, T, kh * G + G, D, FOR_WRITE);
            claim_kv_grads(a, b, kh, g, t0);
            for (int r = 0; r < RB; r++) {
                int64_t t = r < rows ? t0 + r : t0 + rows - 1;
                qr[r] = a->q + b * a->qsb + h * a->qsh + t * a->qst;
                dor[r] = a->dout + ((b * T + t) * H + h) * D;
                dqr[r] = r < rows ? a->dq + b * a->dqsb + h * a->dqsh + t * a->dqst : discard[r];
                delta[r] = a->delta[(b * T + t) * H + h];
            }
            if (!key_range(a, b, t0, rows, Sp, &j0, &j1)) {
                for (int64_t r = 0; r < rows; r++) memset(dqr[r], 0, D * sizeof(float));
                continue;
            }
            int64_t jend = j1 < S ? j1 : S;
            row_dots(qr, sc->kt, Sp, D, j0, j1, sc->p);
            softmax_rows(a, b, t0, rows, sc->p, Sp, j0, j1, a->lse + (b * H + h) * T + t0, NULL, NULL);
            row_dots(dor, sc->vt, Sp, D, j0, j1, sc->dp); /* dP = dO V^T */
            for (int r = 0; r < RB; r++) {                /* dS = P (dP - delta) scale */
                float *pr = sc->p + r * Sp, *dr = sc->dp + r * Sp;
                float dl = delta[r];
                for (int64_t j = j0; j < j1; j++) dr[j] = pr[j] * (dr[j] - dl) * a->scale;
            }
            add_outer(sc->p, Sp, dor, D, j0, jend, sc->dv);       /* dV += P^T dO */
            add_outer(sc->dp, Sp, qr, D, j0, jend, sc->dk);       /* dK += dS^T Q */
            weighted_rows(sc->dp, Sp, sc->kc, D, D, j0, jend, NULL, dqr); /* dQ = dS K */
        }
    }
    if (P) {
        float *rs = a->row_shared + (b * a->KVH + kh) * 2 * P * D;
        memcpy(rs, sc->dk, P * D * sizeof(float));
        memcpy(rs + P * D, sc->dv, P * D * sizeof(float));
    }
    copy_rows(sc->dk + P * D, D, S - P, D, a->dk + b * a->dksb + kh * a->dksh, a->dkst);
    copy_rows(sc->dv + P * D, D, S - P, D, a->dv + b * a->dksb + kh * a->dksh, a->dkst);
}

/* delta[i] = dout[i] . out[i] for every query (B T H rows of D), in one pass over both in memory
 * order (read per block of queries, the rows of one head are H D floats apart and missed the cache). */
static void row_deltas(hr_att *a, int nthreads) {
    int64_t n = a->B * a->T * a->H, D = a->D;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const float *x = a->dout + i * D, *y = a->out + i * D;
        hv acc = hv_mul(hv_loadu(x), hv_loadu(y));
        for (int64_t c = 16; c < D; c += 16) acc = hv_add(acc, hv_mul(hv_loadu(x + c), hv_loadu(y + c)));
        a->delta[i] = hv_reduce_add(acc);
    }
}

/* Adds every row's gradients of its shared keys and values to its group's, row after row: each
 * (kv head, key) is one thread's, so the sums run in the same order on any number of threads. */
static void add_shared_grads(const hr_att *a, int nthreads) {
    int64_t P = a->P, D = a->D;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t i = 0; i < a->KVH * P; i++) {
        int64_t kh = i / P, j = i % P;
        for (int64_t b = 0; b < a->B; b++) {
            int64_t u = a->pidx[b];
            const float *rs = a->row_shared + ((b * a->KVH + kh) * 2 * P + j) * D;
            float *dk = a->dkp + u * a->dkpsb + kh * a->dkpsh + j * a->dkpst;
            float *dv = a->dvp + u * a->dkpsb + kh * a->dkpsh + j * a->dkpst;
            for (int64_t c = 0; c < D; c += 16) {
                hv_storeu(dk + c, hv_add(hv_loadu(dk + c), hv_loadu(rs + c)));
                hv_storeu(dv + c, hv_add(hv_loadu(dv + c), hv_loadu(rs + P * D + c)));
            }
        }
    }
}

/* The mask rows' key ranges (and the backward's deltas), then the (row, kv head) items over the
 * threads, each thread with its own scratch, then (backward, shared keys) the rows' shared-key
 * gradients added to their groups'; 0, or -1 when memory could not be allocated. */
static int run(hr_att *a, int backward, int nthreads) {
    int64_t mask_rows = (a->msb ? a->B : 1) * a->T;
    a->range = malloc(mask_rows * 2 * sizeof(int32_t));
    a->delta = backward ? malloc(a->B * a->T * a->H * sizeof(float)) : NULL;
    a->row_shared = backward && a->P ? malloc(a->B * a->KVH * 2 * a->P * a->D * sizeof(float)) : NULL;
    if (!a->range || (backward && !a->delta) || (backward && a->P && !a->row_shared)) {
        free(a->range), free(a->delta), free(a->row_shared);
        return -1;
    }
    scan_mask(a, nthreads);
    if (backward) row_deltas(a, nthreads);
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        hr_scratch *sc = scratch_new(padded(a->S), a->S, a->D, backward);
        if (!sc) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < a->B * a->KVH; item++) {
            if (!sc) continue;
            request_item(a, item + omp_get_num_threads(), backward);
            if (backward)
                backward_item(a, sc, item / a->KVH, item % a->KVH);
            else
                forward_item(a, sc, item / a->KVH, item % a->KVH);
        }
        scratch_free(sc);
    }
    if (backward && a->P && !failed) add_shared_grads(a, nthreads);
    free(a->range), free(a->delta), free(a->row_shared);
    return failed ? -1 : 0;
}

/* The operands common to both directions: strides in the order (row, head, position); the shared
 * keys kp, vp (P of them, row b reading group pidx[b]'s) are unread when P = 0. */
#define HR_OPERANDS                                                                                       \
    const float *q, int64_t qsb, int64_t qsh, int64_t qst, const float *k, int64_t ksb, int64_t ksh,      \
        int64_t kst, const float *v, int64_t vsb, int64_t vsh, int64_t vst, const float *kp, int64_t kpsb, \
        int64_t kpsh, int64_t kpst, const float *vp, int64_t vpsb, int64_t vpsh, int64_t vpst,            \
        const int64_t *pidx, int64_t P, const uint8_t *mask, int64_t msb, int64_t mst
#define HR_SHAPE int64_t B, int64_t H, int64_t KVH, int64_t T, int64_t S, int64_t D, float scale, int nthreads

static hr_att operands(HR_OPERANDS, int64_t B, int64_t H, int64_t KVH, int64_t T, int64_t S, int64_t D, float scale) {
    hr_att a;
    memset(&a, 0, sizeof(a));
    a.q = q, a.qsb = qsb, a.qsh = qsh, a.qst = qst;
    a.k = k, a.ksb = ksb, a.ksh = ksh, a.kst = kst, a.v = v, a.vsb = vsb, a.vsh = vsh, a.vst = vst;
    a.kp = kp, a.kpsb = kpsb, a.kpsh = kpsh, a.kpst = kpst, a.vp = vp, a.vpsb = vpsb, a.vpsh = vpsh, a.vpst = vpst;
    a.pidx = pidx, a.P = P, a.mask = mask, a.msb = msb, a.mst = mst;
    a.B = B, a.H = H, a.KVH = KVH, a.T = T, a.S = S, a.D = D, a.scale = scale;
    return a;
}

#define HR_ARGS q, qsb, qsh, qst, k, ksb, ksh, kst, v, vsb, vsh, vst, kp, kpsb, kpsh, kpst, vp, vpsb, vpsh, vpst, \
                pidx, P, mask, msb, mst, B, H, KVH, T, S, D, scale

int hr_attention_forward(HR_OPERANDS, float *out, float *lse, HR_SHAPE) {
    hr_att a = operands(HR_ARGS);
    a.out = out, a.lse = lse;
    return run(&a, 0, nthreads);
}

/* dq strides (row, head, position); dk and dv alike, (dksb, dksh, dkst); dkp and dvp alike */
int hr_attention_backward(HR_OPERANDS, const float *out, const float *dout, const float *lse, float *dq,
                          int64_t dqsb, int64_t dqsh, int64_t dqst, float *dk, float *dv, int64_t dksb, int64_t dksh,
                          int64_t dkst, float *dkp, float *dvp, int64_t dkpsb, int64_t dkpsh, int64_t dkpst,
                          HR_SHAPE) {
    hr_att a = operands(HR_ARGS);
    a.out = (float *)out, a.lse = (float *)lse, a.dout = dout;
    a.dq = dq, a.dqsb = dqsb, a.dqsh = dqsh, a.dqst = dqst;
    a.dk = dk, a.dv = dv, a.dksb = dksb, a.dksh = dksh, a.dkst = dkst, a.dkp = dkp, a.dvp = dvp;
    a.dkpsb = dkpsb, a.dkpsh = dkpsh, a.dkpst = dkpst;
    return run(&a, 1, nthreads);
}

/* ------------------------------------------------------------------ token log-probs
 * The update's loss reads log_softmax(logits)[target] at every position. torch makes the whole
 * log_softmax tensor (a read and a write of the logits) and its backward a softmax, a scaling pass
 * and a scatter (two more reads and writes). Here the forward reads each row twice from cache (max,
 * then the sum of exponentials) and writes one float and its log-sum-exp, and where a backward will
 * follow, the exponentials too; the backward scales them into the gradient -g softmax(z) + g at the
 * target in one pass. The exponential is most of both directions' time on a CPU whose vector units
 * are narrow: computing it once rather than twice took the tiny model's (8192, 1024) logits from
 * 15-16 ms forward + 14 ms backward to 15-16 + 4.5 ms (a Zen 1, one thread, medians of 15). The
 * logits are not kept for the backward, the exponentials are (the same size). */

/* Outputs of at least this many floats (8 MB) are written with streaming stores where every row starts
 * on a cache line (the exponentials and gradients here, the transposes, SwiGLU's outputs below): their
 * next reader finds them in memory either way, and a plain store first reads each line it writes.
 * Smaller outputs stay in the cache for whatever reads them next. */
#define STREAM_FLOATS (1 << 21)

/* Whether an output at p of `floats` floats in rows of `row_floats` takes the streaming stores. */
static inline int streams_output(const float *p, int64_t row_floats, int64_t floats) {
    return floats >= STREAM_FLOATS && ((uintptr_t)p & 63) == 0 && (row_floats & 15) == 0;
}

/* out[i] = (z[i][t_i] - max_i) - log(sum_i), sum_i = sum_j exp(z[i][j] - max_i), as torch's log_softmax
 * rounds it; stats[i] = (max_i, sum_i) for the backward; exps (rows, V), unless NULL, = exp(z - max_i);
 * entropy (rows), unless NULL, = -sum_j p_j log p_j = log(sum_i) - sum_j exp(z_j - max_i) (z_j - max_i) /
 * sum_i, from the same pass (the old log-probs' forward reports it: torch's softmax, log_softmax,
 * product and sum were four more passes over the logits). logits (rows, V) contiguous. */
void hr_token_logprob(const float *logits, const int64_t *targets, int64_t rows, int64_t V, float *out, float *stats,
                      float *exps, float *entropy, int nthreads) {
    int stream = exps && streams_output(exps, V, rows * V);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t i = 0; i < rows; i++) {
        const float *z = logits + i * V;
        float *e = exps ? exps + i * V : NULL;
        hv top = hv_set1(NEG);
        int64_t j = 0;
        for (; j + 16 <= V; j += 16) top = hv_max(top, hv_loadu(z + j));
        hm tail = lanes(V - j);
        top = hv_mask_max(top, tail, top, hv_maskz_loadu(tail, z + j));
        float m = hv_reduce_max(top);
        float dot = 0.f;
        float sum = hv_exp_sum_dot(z, m, V, e, stream, entropy ? &dot : NULL);
        stats[2 * i] = m, stats[2 * i + 1] = sum;
        float log_sum = logf(sum);
        out[i] = (z[targets[i]] - m) - log_sum;
        if (entropy) entropy[i] = log_sum - dot / sum;
    }
    if (stream) _mm_sfence();
}

/* x with v added to its lane `lane`, when that is one of its 16 (in registers: the store may stream) */
static inline hv add_at(hv x, int64_t lane, float v) {
    if (lane < 0 || lane >= 16) return x;
    float block[16] __attribute__((aligned(64)));
    hv_storeu(block, x);
    block[lane] += v;
    return hv_loadu(block);
}

/* d (rows, V) = -g_i exps / sum_i, plus g_i at the target: the gradient of out[i] above, from its
 * exponentials. */
void hr_token_logprob_backward(const float *exps, const int64_t *targets, const float *stats, const float *grad,
                               int64_t rows, int64_t V, float *d, int nthreads) {
    int stream = streams_output(d, V, rows * V);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t i = 0; i < rows; i++) {
        const float *e = exps + i * V;
        float *di = d + i * V;
        hv g = hv_set1(-grad[i] / stats[2 * i + 1]);
        int64_t j = 0, t = targets[i];
        for (; j + 16 <= V; j += 16) {
            hv x = add_at(hv_mul(hv_loadu(e + j), g), t - j, grad[i]);
            if (stream)
                hv_stream(di + j, x);
            else
                hv_storeu(di + j, x);
        }
        if (j < V) {
            hm tail = lanes(V - j);
            hv_mask_storeu(di + j, tail, add_at(hv_mul(hv_maskz_loadu(tail, e + j), g), t - j, grad[i]));
        }
    }
    if (stream) _mm_sfence();
}

/* out (cols, rows) = the transpose of x (rows, cols), row stride xs, in 16 x 16 blocks through
 * registers: the weight gradients' inner products read one operand transposed (hybridrl/utils/
 * cpu_matmul.py), and torch's copy of a transposed view ran at 9-21 GB/s where a copy runs at 35-110.
 * A block's 16 rows are 16 streams the hardware prefetcher does not keep ahead of: the next block's
 * rows are requested a few lines per column block ((8288, 384) 1.5 -> 0.6 ms, (4144, 1536) 2.5 ->
 * 1.5 ms with the streaming stores, best of 9). Large outputs stream (`streams_output`): every 64-byte
 * store of a block lands on another line, which a plain store first reads; the SmolLM2 LM head's
 * gradient (512 x 49152) took 40 ms so, 12.5 with them (torch's copy 24). */
void hr_transpose(const float *x, int64_t rows, int64_t cols, int64_t xs, float *out, int nthreads) {
    int64_t row_blocks = (rows + 15) / 16;
    int stream = streams_output(out, rows, rows * cols);
    int64_t lines = (cols * 4 + 63) / 64, per = 16 * ((lines + 15) / 16); /* all of them in 16 column blocks */
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < row_blocks; b++) {
        int64_t r0 = 16 * b, nr = rows - r0 < 16 ? rows - r0 : 16;
        transpose_rows16(x + r0 * xs, xs, nr, cols, b + 1 < row_blocks ? x + (r0 + 16) * xs : NULL, per, out + r0,
                         rows, stream && nr == 16);
    }
    if (stream) _mm_sfence();
}

/* ------------------------------------------------------------------ weight gradients
 * grad_w (out, in) = grad^T x of a linear's gradient grad (m, out) and its input x (m, in), both
 * read in place, rows gs and xs floats apart. oneDNN's products want one operand transposed in
 * memory first (hybridrl/utils/cpu_matmul.py): at the tiny benchmark model's shapes (8346 rows) the
 * copies were 22 of the 158 ms its weight gradients took in an update. The sum over rows needs no
 * transpose when it is a sum of outer products: a register tile of WG_MR outputs x WG_NV vectors of
 * inputs adds grad[k][o] (broadcast) times x[k][i..] for each row k, reading a few floats of one row
 * of each operand per step, the outputs staying in L2 and a chunk of rows of both operands too.
 * At the tiny model's shapes (8346 rows), best of 9, one thread, a Zen 4, GFLOP/s here / oneDNN's
 * with its copies: q and o (128 x 128) 107 / 96, k and v (64 x 128) 112 / 103, gate and up (384 x
 * 128) 102 / 95, down (128 x 384) 97 / 95, LM head (1024 x 128) 101 / 95; in whole updates (steps
 * alternating in one process) the weight gradients took 0.123 s instead of 0.145, the update 0.486
 * instead of 0.510 (two threads: 0.292 instead of 0.303). Each output is one thread's, summed over
 * rows in order: the same floats on any number of threads. */
#if HR_SIMD == 512
#define WG_MR 8 /* 8 x 2 accumulators, 2 operand vectors, a broadcast: 19 of 32 registers */
#define WG_NV 2
#else
#define WG_MR 6 /* AVX2: 6 x 1 vectors (12 ymm), 2 + 1 operands: 15 of 16 */
#define WG_NV 1
#endif
#define WG_OPERANDS (64 * 1024) /* floats of both operands' rows in a chunk: 256 rows at 128 x 128 */

/* The register tile both products below run: c (rows x nv vectors, row stride ldc) = (acc ? c : 0)
 * + sum_{k < n} a[k ka + r ra] (x) b[k kb + 16 v ..], plus add[16 v ..] as it is stored (NULL: none);
 * rows <= MR <= TILE_MAX_MR, nv <= TILE_MAX_NV, inlined with MR constant (whole tiles: rows and nv too). The weight
 * gradient broadcasts grad's values along a row (ra 1) and sums over rows; the linear product
 * broadcasts x's down its rows (ka 1) and sums along them. */
#define TILE_MAX_MR 8
#define TILE_MAX_NV 4
static inline __attribute__((always_inline)) void outer_tile(const float *a, int64_t ka, int64_t ra, const float *b,
                                                              int64_t kb, int64_t n, float *c, int64_t ldc,
                                                              const float *add, int rows, int nv, int acc,
                                                              const int MR) {
    hv s[TILE_MAX_MR][TILE_MAX_NV];
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < nv; v++) s[r][v] = !acc || r >= rows ? hv_zero() : hv_loadu(c + r * ldc + 16 * v);
    /* Unrolled four steps a turn: the loop's own instructions once per four (the same FMAs in the
     * same order, so the same bits). A Xeon (family 6, model 167), one thread, the cache flushed
     * before each product, the two builds alternating in one process, a forward's linears (ms,
     * medians): the 25M model's at 4144 rows 166.9 / 167.1 -> 161.5 / 162.6, the tiny model's at
     * 8346 rows 32.6 / 33.6 -> 31.0 / 32.5, SmolLM2's at 2048 rows 760 -> 752; the AVX2 build run
     * there 294.5 -> 281.3 and 54.6 -> 50.0. */
#pragma GCC unroll 4
    for (int64_t k = 0; k < n; k++) {
        hv bv[TILE_MAX_NV];
        for (int v = 0; v < nv; v++) bv[v] = hv_loadu(b + k * kb + 16 * v);
        for (int r = 0; r < MR; r++) {
            hv x = hv_set1(a[k * ka + (r < rows ? r : 0) * ra]);
            for (int v = 0; v < nv; v++) s[r][v] = hv_fmadd(x, bv[v], s[r][v]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < nv; v++)
            hv_storeu(c + r * ldc + 16 * v, add ? hv_add(s[r][v], hv_loadu(add + 16 * v)) : s[r][v]);
}

/* c (out, in) contiguous = grad^T x as above; -1 (nothing written) unless in is a multiple of 16.
 * All outputs stay in L2 between chunks of rows, so any shape is computed but only those of up to
 * about 128 K outputs (512 KB) run fast: hybridrl/engine/cpu_attention.py takes the kernel for those.
 * With `bias`, also its gradient, grad summed over the rows (out floats), from each chunk of grad while
 * it is in L2: torch's column sum read all of grad again from memory, 1.02-1.06 ms for the tiny model's
 * q-k-v product (8304 x 256) with the cache cold, where the sum here adds 0.13-0.24 ms. Rows in order
 * again, each column one thread's. */
int hr_weight_grad(const float *g, int64_t gs, const float *x, int64_t xs, int64_t m, int64_t out, int64_t in,
                   float *c, float *bias, int nthreads) {
    if (in % 16 || out <= 0 || in <= 0) return -1;
    if (bias) memset(bias, 0, out * sizeof(float));
    if (m == 0) {
        memset(c, 0, out * in * sizeof(float));
        return 0;
    }
    const int64_t W = 16 * WG_NV, tiles = (out + WG_MR - 1) / WG_MR, col_tiles = (in + W - 1) / W;
    int64_t chunk = WG_OPERANDS / (out + in);
    chunk = chunk < 32 ? 32 : chunk > 512 ? 512 : chunk;
    for (int64_t k0 = 0; k0 < m; k0 += chunk) {
        int64_t rows_k = m - k0 < chunk ? m - k0 : chunk;
        const float *gk = g + k0 * gs, *xk = x + k0 * xs;
#pragma omp parallel num_threads(nthreads)
        {
#pragma omp for collapse(2) schedule(static) nowait
        for (int64_t t = 0; t < tiles; t++)
            for (int64_t ct = 0; ct < col_tiles; ct++) {
                int64_t o = t * WG_MR, i = ct * W;
                int rows = out - o < WG_MR ? (int)(out - o) : WG_MR;
                float *tile_out = c + o * in + i;
                if (i + W <= in && rows == WG_MR)
                    outer_tile(gk + o, gs, 1, xk + i, xs, rows_k, tile_out, in, NULL, WG_MR, WG_NV, k0 > 0, WG_MR);
                else if (i + W <= in)
                    outer_tile(gk + o, gs, 1, xk + i, xs, rows_k, tile_out, in, NULL, rows, WG_NV, k0 > 0, WG_MR);
                else /* a last 16 columns (AVX-512) */
                    outer_tile(gk + o, gs, 1, xk + i, xs, rows_k, tile_out, in, NULL, rows, 1, k0 > 0, WG_MR);
            }
        if (bias) {
#pragma omp for schedule(static)
            for (int64_t o = 0; o < out; o += 16) {
                hm in_row = lanes(out - o);
                hv s = hv_maskz_loadu(in_row, bias + o);
                for (int64_t k = 0; k < rows_k; k++) s = hv_add(s, hv_maskz_loadu(in_row, gk + k * gs + o));
                hv_mask_storeu(bias + o, in_row, s);
            }
        }
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ linear products
 * y (m, out) = x (m, in) w^T (+ bias): a linear's forward, and with w a transposed view its input
 * gradient. w is first copied into panels of LN_W output columns, (in, LN_W) each, so a tile reads
 * its panel row by row in order; a tile of LN_MR rows of x and one panel sums over all of `in` in
 * registers (24 accumulators, 4 operand vectors, a broadcast) and stores once. oneDNN's products read
 * these operands cold from memory in an update, and there ran slower than this at the tiny model's
 * shapes (8304 rows, one thread, a Zen 4, the cache flushed before each, medians of 9, GFLOP/s
 * here / oneDNN's): o 128 x 128 81.8 / 69.6, its input gradient 80.0 / 65.8, q-k-v 256 x 128 88.0
 * / 76.1, its input gradient 81.4 / 71.6, gate-up 768 x 128 104.8 / 95.4, down 128 x 384 103.3 /
 * 97.7, LM head 1024 x 128 104.5 / 95.2. Each output is one thread's, summed in order over `in`. */
#if HR_SIMD == 512
#define LN_MR 6
#define LN_NV 4
#else
#define LN_MR 6 /* AVX2: 6 x 1 pairs of ymm, 2 operands and a broadcast: 15 of 16 */
#define LN_NV 1
#endif
#define LN_W (16 * LN_NV)
/* Panels a tile passes over before the next tile: 512 KB of them, half a Zen 4's or Zen 5's L2. Each
 * tile used to pass over every panel, so a weight larger than L2 was read from L3 once per 6-row tile.
 * On an Intel Xeon (2 MB L2, two 512-bit FMA units per core, 222 GFLOP/s a thread) that ran the 25M
 * model's products at 74-97 GFLOP/s on one thread, and SmolLM2's at 81-89, against 141-200 for
 * weights that fit; in blocks they run at 150-196 (2048-8192 rows, cold operands, best of 5; two
 * threads 143-189 -> 280-409). Blocks of 128 KB to 1 MB ran within 10% of each other. Each
 * output is still summed over `in` in order, so the results are the same bits. */
#define LN_BLOCK (512 * 1024)

/* y (m, out) contiguous = x w^T (+ bias, out floats, or NULL): x rows xs apart, w[o][i] at
 * w + o * wso + i * wsi (any layout); -1 (nothing written) unless out is a multiple of 16, -2 when
 * memory for the panels could not be allocated. */
int hr_linear(const float *x, int64_t xs, int64_t m, int64_t in, const float *w, int64_t wso, int64_t wsi,
              int64_t out, const float *bias, float *y, int nthreads) {
    if (out % 16 || out <= 0 || in <= 0) return -1;
    int64_t panels = (out + LN_W - 1) / LN_W, tiles = (m + LN_MR - 1) / LN_MR;
    /* the panels in blocks of about LN_BLOCK bytes (at least one panel), each block passed over by
     * every tile before the next (the threads keep the same tiles from block to block, so no barrier
     * between blocks) */
    int64_t panel_bytes = in * LN_W * (int64_t)sizeof(float);
    int64_t per_block = LN_BLOCK > panel_bytes ? LN_BLOCK / panel_bytes : 1;
    float *pw = aligned_alloc(64, round_up(panels * panel_bytes, 64));
    if (!pw) return -2;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            int64_t cols = out - p * LN_W < LN_W ? out - p * LN_W : LN_W;
            for (int64_t i = 0; i < in; i++)
                for (int64_t c = 0; c < cols; c++) pw[(p * in + i) * LN_W + c] = w[(p * LN_W + c) * wso + i * wsi];
        }
        for (int64_t pb = 0; pb < panels; pb += per_block) {
            int64_t pe = pb + per_block < panels ? pb + per_block : panels;
#pragma omp for schedule(static) nowait
            for (int64_t t = 0; t < tiles; t++) {
                int64_t r0 = t * LN_MR;
                int rows = m - r0 < LN_MR ? (int)(m - r0) : LN_MR;
                for (int64_t p = pb; p < pe; p++) {
                    const float *panel = pw + p * in * LN_W, *bp = bias ? bias + p * LN_W : NULL;
                    float *yp = y + r0 * out + p * LN_W;
                    int nv = out - p * LN_W < LN_W ? (int)((out - p * LN_W) / 16) : LN_NV;
                    if (rows == LN_MR && nv == LN_NV)
                        outer_tile(x + r0 * xs, 1, xs, panel, LN_W, in, yp, out, bp, LN_MR, LN_NV, 0, LN_MR);
                    else
                        outer_tile(x + r0 * xs, 1, xs, panel, LN_W, in, yp, out, bp, rows, nv, 0, LN_MR);
                }
            }
        }
    }
    free(pw);
    return 0;
}

/* ------------------------------------------------------------------ SwiGLU
 * A gated MLP's down_proj(silu(gate) * up) (Llama, Qwen2, SmolLM2): silu(g) u = g u / (1 + exp(-g))
 * forward, and both gradients in one pass backward, with s = sigmoid(g): d_up = dh g s and d_gate =
 * dh u s (1 + g (1 - s)), torch's silu_backward. Inductor's fused loops took 7.5 ms forward and 12
 * ms backward per layer of the tiny benchmark's update ((8288, 384) operands, a Zen 1, one thread),
 * most of it in their exponential; these take about 6.5 and 8. */
#define SWIGLU_BLOCK 4096 /* split over the threads from 4 x this many floats */

static inline void swiglu_backward16(hv g, hv u, hv dh, hv *dg, hv *du) {
    const hv one = hv_set1(1.f);
    hv e = hv_exp_neg(g), s = hv_div(one, hv_add(one, e)), ds = hv_mul(dh, s);
    *du = hv_mul(ds, g);
    *dg = hv_mul(hv_mul(ds, u), hv_fmadd(g, hv_sub(one, s), one));
}

/* Where g and u lie: row r's values j .. j + 15 (j a multiple of 16) at g + r gs + (j / 16) step, u
 * likewise. Two tensors of one shape: gs = cols, step = 16. One fused gate-up product whose weight
 * rows alternate 16 of gate_proj's and 16 of up_proj's (cpu_layers): u = g + 16, gs = 2 cols, step =
 * 32, each row read once in memory order. (The plain concatenation, gate's half then up's, read
 * two 1.5 KB runs per 3 KB row and took twice as long: 3.3-3.5 against 1.4-1.5 ms at (8342, 384),
 * a Zen 4, one thread, where the interleaved rows take 1.4.) Tails (cols not a multiple of 16) only
 * with step 16. */

/* Large outputs stream (`streams_output`): their next reader (the down projection forward, the gate and
 * up products' gradients backward) finds them in memory. The same bits. On an Intel Xeon, one thread,
 * cold operands, medians of 14 alternating: (4144, 1536) forward 6.23 -> 5.75 ms, the fused gate-up's
 * backward 9.82 -> 8.20, the plain backward 10.37 -> 8.09; (8346, 384) fused backward 4.98 -> 4.18.
 * Whole 25M updates alternating per step: 4.962 -> 4.897 s and 4.827 -> 4.807 s (medians of 8 and 14). */

/* h (rows, cols) contiguous = silu(g) u */
void hr_swiglu(const float *g, const float *u, int64_t gs, int64_t step, float *h, int64_t rows, int64_t cols,
               int nthreads) {
    int stream = streams_output(h, cols, rows * cols);
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows * cols >= 4 * SWIGLU_BLOCK)
    for (int64_t r = 0; r < rows; r++) hv_swiglu_row(g + r * gs, u + r * gs, step, h + r * cols, cols, stream);
    if (stream) _mm_sfence();
}

/* dg, du (laid out as g and u): the gradients of hr_swiglu's h for dh (rows, cols) contiguous */
void hr_swiglu_backward(const float *g, const float *u, int64_t gs, int64_t step, const float *dh, float *dg,
                        float *du, int64_t rows, int64_t cols, int nthreads) {
    /* every 16 values aligned where the rows are: step a multiple of 16 (tails, masked, store plainly) */
    int stream = streams_output(dg, gs, rows * cols) && streams_output(du, gs, rows * cols) && (step & 15) == 0;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows * cols >= 4 * SWIGLU_BLOCK)
    for (int64_t r = 0; r < rows; r++) {
        const float *gr = g + r * gs, *ur = u + r * gs, *dhr = dh + r * cols;
        float *dgr = dg + r * gs, *dur = du + r * gs;
        int64_t j = 0, at = 0;
        hv a, c;
        for (; j + 16 <= cols; j += 16, at += step) {
            swiglu_backward16(hv_loadu(gr + at), hv_loadu(ur + at), hv_loadu(dhr + j), &a, &c);
            if (stream)
                hv_stream(dgr + at, a), hv_stream(dur + at, c);
            else
                hv_storeu(dgr + at, a), hv_storeu(dur + at, c);
        }
        if (j < cols) {
            hm m = lanes(cols - j);
            swiglu_backward16(hv_maskz_loadu(m, gr + at), hv_maskz_loadu(m, ur + at), hv_maskz_loadu(m, dhr + j), &a, &c);
            hv_mask_storeu(dgr + at, m, a), hv_mask_storeu(dur + at, m, c);
        }
    }
    if (stream) _mm_sfence();
}

/* ------------------------------------------------------------------ RMSNorm
 * y = w (x r), r = 1 / sqrt(mean(x^2) + eps) per row (Llama, Qwen2 and Mistral's RMSNorm), and its
 * backward in one pass over the rows: with n = x r and g = w dy, dx = r (g - n mean(g n)) and dw =
 * the sum over rows of dy n. A compiled block's loops took the weight's gradient as a sum down the
 * columns, 8 at a time, each one a pass over every row of its seven operands: 5.3 ms per layer of
 * the tiny benchmark's update ((8288, 128), a Zen 1). Here each block of NORM_BLOCK rows adds into
 * a partial sum of its own, and the partials are added in block order, so one and two threads give
 * the same floats. */
#define NORM_BLOCK 64

/* 1 / sqrt(t) correctly rounded: in double, as -ffast-math would make 1.f / sqrtf an estimate */
static inline float inv_sqrt(float t) { return (float)(1.0 / sqrt((double)t)); }

static inline float row_sum_squares(const float *x, int64_t cols) {
    hv acc = hv_zero();
    int64_t j = 0;
    for (; j + 16 <= cols; j += 16) {
        hv v = hv_loadu(x + j);
        acc = hv_add(acc, hv_mul(v, v));
    }
    if (j < cols) {
        hv v = hv_maskz_loadu(lanes(cols - j), x + j);
        acc = hv_add(acc, hv_mul(v, v));
    }
    return hv_reduce_add(acc);
}

void hr_rms_norm(const float *x, const float *w, float *y, float *rstd, int64_t rows, int64_t cols, float eps,
                 int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows * cols >= 16384)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * cols;
        float *yr = y + r * cols;
        float s = inv_sqrt(row_sum_squares(xr, cols) / (float)cols + eps);
        rstd[r] = s;
        hv vs = hv_set1(s);
        int64_t j = 0;
        for (; j + 16 <= cols; j += 16) hv_storeu(yr + j, hv_mul(hv_loadu(w + j), hv_mul(hv_loadu(xr + j), vs)));
        if (j < cols) {
            hm m = lanes(cols - j);
            hv_mask_storeu(yr + j, m, hv_mul(hv_maskz_loadu(m, w + j), hv_mul(hv_maskz_loadu(m, xr + j), vs)));
        }
    }
}

/* dx (rows, cols) and dw (cols) of hr_rms_norm's y for dy; partial: (ceil(rows / NORM_BLOCK), cols) scratch */
void hr_rms_norm_backward(const float *x, const float *w, const float *rstd, const float *dy, float *dx, float *dw,
                          float *partial, int64_t rows, int64_t cols, int nthreads) {
    int64_t blocks = (rows + NORM_BLOCK - 1) / NORM_BLOCK;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows * cols >= 16384)
    for (int64_t b = 0; b < blocks; b++) {
        float *acc = partial + b * cols;
        memset(acc, 0, cols * sizeof(float));
        int64_t end = (b + 1) * NORM_BLOCK < rows ? (b + 1) * NORM_BLOCK : rows;
        for (int64_t r = b * NORM_BLOCK; r < end; r++) {
            const float *xr = x + r * cols, *dyr = dy + r * cols;
            float *dxr = dx + r * cols;
            hv vs = hv_set1(rstd[r]), dot = hv_zero();
            int64_t j = 0;
            hm tail = lanes(cols - cols / 16 * 16);
            /* mean(g n) and the weight's partial sums */
            for (; j + 16 <= cols; j += 16) {
                hv n = hv_mul(hv_loadu(xr + j), vs), d = hv_loadu(dyr + j);
                dot = hv_add(dot, hv_mul(hv_mul(hv_loadu(w + j), d), n));
                hv_storeu(acc + j, hv_add(hv_loadu(acc + j), hv_mul(d, n)));
            }
            if (j < cols) {
                hv n = hv_mul(hv_maskz_loadu(tail, xr + j), vs), d = hv_maskz_loadu(tail, dyr + j);
                dot = hv_add(dot, hv_mul(hv_mul(hv_maskz_loadu(tail, w + j), d), n));
                hv_mask_storeu(acc + j, tail, hv_add(hv_maskz_loadu(tail, acc + j), hv_mul(d, n)));
            }
            hv mean = hv_set1(hv_reduce_add(dot) / (float)cols);
            for (j = 0; j + 16 <= cols; j += 16) {
                hv n = hv_mul(hv_loadu(xr + j), vs), g = hv_mul(hv_loadu(w + j), hv_loadu(dyr + j));
                hv_storeu(dxr + j, hv_mul(vs, hv_sub(g, hv_mul(n, mean))));
            }
            if (j < cols) {
                hv n = hv_mul(hv_maskz_loadu(tail, xr + j), vs);
                hv g = hv_mul(hv_maskz_loadu(tail, w + j), hv_maskz_loadu(tail, dyr + j));
                hv_mask_storeu(dxr + j, tail, hv_mul(vs, hv_sub(g, hv_mul(n, mean))));
            }
        }
    }
    memset(dw, 0, cols * sizeof(float));
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t j = 0; j < cols; j++) dw[j] += partial[b * cols + j];
}

/* ------------------------------------------------------------------ rotary position embedding
 * transformers' apply_rotary_pos_emb: x cos + rotate_half(x) sin, rotate_half(x) = (-x2, x1) for
 * the halves x1, x2 of each head's D values. Inductor made rotate_half a tensor of its own (a copy
 * and a negated copy) before the products, and its backward as many passes: 2.6 ms forward and 3.8
 * backward per layer of the tiny benchmark's update (8304 positions, 4 + 2 heads of 32, a Zen 1, one
 * thread). Here each direction is one pass over the heads, position by position (cos and sin are
 * read once per position for all its heads). Forward, per half: o1 = x1 c1 - x2 s1, o2 = x2 c2 + x1 s2;
 * backward: d1 = g1 c1 + g2 s2, d2 = g2 c2 - g1 s1. Each is a product, a product and one addition or
 * subtraction, as torch's eager ops round them (contraction into fused multiply-adds is off).
 *
 * x, out (B, H, T, D) strides xsb, xsh, xst and osb, osh, ost (D contiguous); cos, sin (B or 1, T, D)
 * strides csb (0: one for every row), cst. D a multiple of 32. */
void hr_rope(const float *x, int64_t xsb, int64_t xsh, int64_t xst, const float *cos, const float *sin, int64_t csb,
             int64_t cst, int64_t B, int64_t H, int64_t T, int64_t D, float *out, int64_t osb, int64_t osh,
             int64_t ost, int backward, int nthreads) {
    int64_t half = D / 2;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t bt = 0; bt < B * T; bt++) {
        int64_t b = bt / T, t = bt % T;
        const float *c = cos + b * csb + t * cst, *sn = sin + b * csb + t * cst;
        for (int64_t h = 0; h < H; h++) {
            const float *xr = x + b * xsb + h * xsh + t * xst;
            float *orow = out + b * osb + h * osh + t * ost;
            for (int64_t j = 0; j < half; j += 16) {
                hv x1 = hv_loadu(xr + j), x2 = hv_loadu(xr + half + j);
                hv c1 = hv_loadu(c + j), c2 = hv_loadu(c + half + j);
                hv s1 = hv_loadu(sn + j), s2 = hv_loadu(sn + half + j);
                if (backward) {
                    hv_storeu(orow + j, hv_add(hv_mul(x1, c1), hv_mul(x2, s2)));
                    hv_storeu(orow + half + j, hv_sub(hv_mul(x2, c2), hv_mul(x1, s1)));
                } else {
                    hv_storeu(orow + j, hv_sub(hv_mul(x1, c1), hv_mul(x2, s1)));
                    hv_storeu(orow + half + j, hv_add(hv_mul(x2, c2), hv_mul(x1, s2)));
                }
            }
        }
    }
}
#else
int hr_attention_supported(void) { return 0; }
#endif
