/* Matrix products with GGUF block-quantized weights, fp32 activations (engine/quant.py builds
 * and loads this file; no Python or torch headers, called through ctypes).
 *
 *   y[M, N] = x[M, K] @ W[N, K]^T,  W kept in the checkpoint's own blocks of 32 weights:
 *     Q4_1  w = d * q + m        q in 0..15, two per byte (low nibbles weights 0-15, high 16-31)
 *     Q4_0  w = d * (q - 8)      the same layout with zero = 8 and m = 0
 *     Q8_0  w = d * q            q in -128..127
 *   with d and m widened to fp32 once at load (exact: the file stores them as fp16).
 *
 * Each weight is expanded in registers to the fp32 value gguf-py's dequantize gives (d * q
 * rounded, then + m rounded: the very weights of the dequantized fp32 engine), then
 * y[r, n] = sum_j w_j x[r, j] with fma, eight partial sums (lanes) folded at the end. Only
 * the blocks stream from memory: 0.75 byte a weight for Q4_1 against 4 for fp32, which is
 * what bounds a decode step. Up to ROWS rows share one expansion of a column in registers;
 * more rows expand TCOLS columns at a time into a per-thread buffer (3 x 4 x k bytes: L1
 * for k <= ~2,700) and run a 4 x TCOLS register tile over it, so a column's blocks are read
 * from memory once whatever M is.
 *
 * Batch invariant by construction: a row's result is the same sequence of operations on its
 * own accumulators whatever the other rows are (no reassociation: no -ffast-math; every
 * fma is written out), and each output is computed by exactly one thread. The threads are
 * OpenMP's: the library links libgomp.so.1, which in a torch process is torch's own copy,
 * so the kernels share torch's pool instead of competing with it.
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define DISAGG_AVX2 1
#endif

#define GROUP 32
#define ROWS 4 /* rows sharing one expansion of a column in registers */

int disagg_qmatmul_simd(void) {
#ifdef DISAGG_AVX2
    return 1;
#else
    return 0;
#endif
}

/* Columns c .. c+nc-1 expanded to fp32 in out [nc, k]: the same roundings as gguf-py's
 * dequantize (no fma here: built with -ffp-contract=off). */
static void q4_expand(const uint8_t *qs, const float *d, const float *mn, int zero, int64_t ng,
                      int64_t nc, float *out) {
    for (int64_t i = 0; i < nc * ng; i++) {
        const uint8_t *b = qs + i * 16;
        float *o = out + i * GROUP;
        for (int j = 0; j < 16; j++) {
            o[j] = d[i] * (float)((b[j] & 0x0F) - zero) + mn[i];
            o[j + 16] = d[i] * (float)((b[j] >> 4) - zero) + mn[i];
        }
    }
}

static void q8_expand(const int8_t *qs, const float *d, int64_t ng, int64_t nc, float *out) {
    for (int64_t i = 0; i < nc * ng; i++)
        for (int j = 0; j < GROUP; j++) out[i * GROUP + j] = d[i] * (float)qs[i * GROUP + j];
}

#ifdef DISAGG_AVX2
static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    __m128 s = _mm_add_ps(lo, hi);                  /* 4 lanes */
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));         /* 2 lanes */
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 0x55));  /* 1 lane */
    return _mm_cvtss_f32(s);
}

static inline __m256 expand8(__m128i q8, __m256 dg, __m256 mg) {
    /* d * q + m, rounded twice like the scalar expansion */
    return _mm256_add_ps(_mm256_mul_ps(dg, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8))), mg);
}

#define INLINE static inline __attribute__((always_inline))

/* One group's weights of a column, expanded: w[0..3] (8 lanes each). */
INLINE void q4_group(const uint8_t *qs, float d, float m, int zero, __m256 w[4]) {
    const __m128i low4 = _mm_set1_epi8(0x0F), z = _mm_set1_epi8((char)zero);
    __m128i b = _mm_loadu_si128((const __m128i *)qs);
    __m128i lo = _mm_sub_epi8(_mm_and_si128(b, low4), z);
    __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(b, 4), low4), z);
    __m256 dg = _mm256_set1_ps(d), mg = _mm256_set1_ps(m);
    w[0] = expand8(lo, dg, mg), w[1] = expand8(_mm_srli_si128(lo, 8), dg, mg);
    w[2] = expand8(hi, dg, mg), w[3] = expand8(_mm_srli_si128(hi, 8), dg, mg);
}

INLINE void q8_group(const int8_t *qs, float d, __m256 w[4]) {
    const __m128i *q = (const __m128i *)qs;
    __m128i a = _mm_loadu_si128(q), b = _mm_loadu_si128(q + 1);
    /* d * q, exact in fp32 (11 x 8 significant bits): the expansion's value */
    __m256 dg = _mm256_set1_ps(d);
#define Q8(v) _mm256_mul_ps(dg, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)))
    w[0] = Q8(a), w[1] = Q8(_mm_srli_si128(a, 8)), w[2] = Q8(b), w[3] = Q8(_mm_srli_si128(b, 8));
#undef Q8
}

/* Two columns (c1 may repeat c0: then only c0 is written) against NR <= ROWS rows, expanded
 * in registers. Two columns give the core two independent fma chains per row; every
 * (row, column) sums in the same order whatever NR and the neighbour column are. NR is a
 * constant at each call (switch below), so the accumulators stay in registers. */
INLINE void pair(const float *x, int64_t k, const int NR, const uint8_t *q0, const uint8_t *q1,
                 const float *d0, const float *d1, const float *m0, const float *m1, int zero,
                 const int q8, int64_t nc, float *y, int64_t ldy) {
    __m256 acc[ROWS][2], w[2][4];
    for (int r = 0; r < NR; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < k / GROUP; g++) {
        if (q8) {
            q8_group((const int8_t *)q0 + g * GROUP, d0[g], w[0]);
            q8_group((const int8_t *)q1 + g * GROUP, d1[g], w[1]);
        } else {
            q4_group(q0 + g * 16, d0[g], m0[g], zero, w[0]);
            q4_group(q1 + g * 16, d1[g], m1[g], zero, w[1]);
        }
        for (int r = 0; r < NR; r++) {
            const float *p = x + r * k + g * GROUP;
            for (int s = 0; s < 4; s++) {
                __m256 xv = _mm256_loadu_ps(p + 8 * s);
                acc[r][0] = _mm256_fmadd_ps(w[0][s], xv, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(w[1][s], xv, acc[r][1]);
            }
        }
    }
    for (int r = 0; r < NR; r++)
        for (int64_t c = 0; c < nc; c++) y[r * ldy + c] = hsum8(acc[r][c]);
}

#define PAIR(NR, Q8) pair(x, k, NR, q0, q1, d0, d1, m0, m1, zero, Q8, nc, y, ldy)
static void direct_pair(const float *x, int64_t k, int64_t nr, const uint8_t *q0,
                        const uint8_t *q1, const float *d0, const float *d1, const float *m0,
                        const float *m1, int zero, int q8, int64_t nc, float *y, int64_t ldy) {
    /* every (rows, format) its own copy: constants unroll the rows, drop the format test */
    switch (nr * 2 + (q8 != 0)) {
    case 2: PAIR(1, 0); break;
    case 3: PAIR(1, 1); break;
    case 4: PAIR(2, 0); break;
    case 5: PAIR(2, 1); break;
    case 6: PAIR(3, 0); break;
    case 7: PAIR(3, 1); break;
    case 8: PAIR(4, 0); break;
    default: PAIR(4, 1); break;
    }
}
#undef PAIR

/* q4_expand and q8_expand with the group expansions above: the same values (a multiply and
 * an add, each rounded, as in the scalar loops), eight at a time. The scalar loops took most
 * of a 16-row product's time: each column's expansion is done once for all its rows. */
static void q4_expand_v(const uint8_t *qs, const float *d, const float *mn, int zero, int64_t ng,
                        int64_t nc, float *out) {
    for (int64_t i = 0; i < nc * ng; i++) {
        __m256 w[4];
        q4_group(qs + i * 16, d[i], mn[i], zero, w);
        for (int s = 0; s < 4; s++) _mm256_storeu_ps(out + i * GROUP + 8 * s, w[s]);
    }
}

static void q8_expand_v(const int8_t *qs, const float *d, int64_t ng, int64_t nc, float *out) {
    for (int64_t i = 0; i < nc * ng; i++) {
        __m256 w[4];
        q8_group(qs + i * GROUP, d[i], w);
        for (int s = 0; s < 4; s++) _mm256_storeu_ps(out + i * GROUP + 8 * s, w[s]);
    }
}
#define Q4_EXPAND q4_expand_v
#define Q8_EXPAND q8_expand_v

/* Rows r0 .. r0+NR-1 (NR <= ROWS) against nc <= TCOLS expanded columns w [nc, k]: 12
 * accumulators, three weight vectors and one of x fill the 16 registers. NR is a constant at
 * each call (tile() below), so the accumulators stay in registers: with a run-time row count
 * they lived on the stack, a load and a store around every fma. */
#define TCOLS 3
INLINE void tile_n(const float *x, int64_t k, const int NR, const float *w, int64_t nc,
                   float *y, int64_t ldy) {
    __m256 acc[ROWS][TCOLS];
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < TCOLS; c++) acc[r][c] = _mm256_setzero_ps();
    const float *w1 = nc > 1 ? w + k : w, *w2 = nc > 2 ? w + 2 * k : w;
    for (int64_t j = 0; j < k; j += 8) {
        __m256 a = _mm256_loadu_ps(w + j), b = _mm256_loadu_ps(w1 + j);
        __m256 e = _mm256_loadu_ps(w2 + j);
        for (int r = 0; r < NR; r++) {
            __m256 xv = _mm256_loadu_ps(x + r * k + j);
            acc[r][0] = _mm256_fmadd_ps(a, xv, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(b, xv, acc[r][1]);
            acc[r][2] = _mm256_fmadd_ps(e, xv, acc[r][2]);
        }
    }
    for (int r = 0; r < NR; r++)
        for (int64_t c = 0; c < nc; c++) y[r * ldy + c] = hsum8(acc[r][c]);
}

static void tile(const float *x, int64_t k, int64_t nr, const float *w, int64_t nc, float *y,
                 int64_t ldy) {
    switch (nr) {
    case 1: tile_n(x, k, 1, w, nc, y, ldy); break;
    case 2: tile_n(x, k, 2, w, nc, y, ldy); break;
    case 3: tile_n(x, k, 3, w, nc, y, ldy); break;
    default: tile_n(x, k, 4, w, nc, y, ldy); break;
    }
}
#else
#define Q4_EXPAND q4_expand
#define Q8_EXPAND q8_expand
#define TCOLS 2
/* Portable fallback: the same expanded weights and eight-lane partial sums as the SIMD path
 * (it matches that path up to fma rounding). */
static void tile(const float *x, int64_t k, int64_t nr, const float *w, int64_t nc, float *y,
                 int64_t ldy) {
    for (int64_t r = 0; r < nr; r++) {
        for (int64_t c = 0; c < nc; c++) {
            float lane[8] = {0};
            for (int64_t j = 0; j < k; j++) lane[j % 8] += w[c * k + j] * x[r * k + j];
            float s4[4], s2[2];
            for (int i = 0; i < 4; i++) s4[i] = lane[i] + lane[i + 4];
            for (int i = 0; i < 2; i++) s2[i] = s4[i] + s4[i + 2];
            y[r * ldy + c] = s2[0] + s2[1];
        }
    }
}
#endif

/* Columns split among the threads: up to ROWS rows in pairs expanded in registers; more rows
 * in groups of TCOLS columns expanded once into buf and multiplied with every row. */
static void columns(const float *x, int64_t m_rows, int64_t k, int64_t n, float *y,
                    int threads, const void *qs, const float *d, const float *mn, int zero,
                    int q8) {
    int64_t ng = k / GROUP, width = q8 ? GROUP : 16, bytes = ng * width;
#pragma omp parallel num_threads(threads)
    {
#ifdef DISAGG_AVX2
        if (m_rows <= ROWS) {
#pragma omp for schedule(static)
            for (int64_t c = 0; c < n; c += 2) {
                int64_t nc = n - c < 2 ? n - c : 2, c1 = nc > 1 ? c + 1 : c;
                const float *m0 = q8 ? d : mn + c * ng, *m1 = q8 ? d : mn + c1 * ng;
                direct_pair(x, k, m_rows, (const uint8_t *)qs + c * bytes,
                            (const uint8_t *)qs + c1 * bytes, d + c * ng, d + c1 * ng, m0, m1,
                            zero, q8, nc, y + c, n);
            }
        } else
#endif
        {
            float buf[TCOLS * k];
#pragma omp for schedule(static)
            for (int64_t c = 0; c < n; c += TCOLS) {
                int64_t nc = n - c < TCOLS ? n - c : TCOLS;
                const uint8_t *qc = (const uint8_t *)qs + c * bytes;
                if (q8)
                    Q8_EXPAND((const int8_t *)qc, d + c * ng, ng, nc, buf);
                else
                    Q4_EXPAND(qc, d + c * ng, mn + c * ng, zero, ng, nc, buf);
                for (int64_t r0 = 0; r0 < m_rows; r0 += ROWS) {
                    int64_t nr = m_rows - r0 < ROWS ? m_rows - r0 : ROWS;
                    tile(x + r0 * k, k, nr, buf, nc, y + r0 * n + c, n);
                }
            }
        }
    }
}

/* x [M, K] fp32 row-major; qs [N, K/32, 16] uint8; d, mn [N, K/32] fp32; y [M, N] fp32;
 * zero: 0 (Q4_1) or 8 (Q4_0, with mn all zeros). */
void disagg_q4_matmul(const float *x, int64_t m_rows, int64_t k, const uint8_t *qs,
                      const float *d, const float *mn, int zero, int64_t n, float *y,
                      int threads) {
    columns(x, m_rows, k, n, y, threads, qs, d, mn, zero, 0);
}

/* x [M, K]; qs [N, K/32, 32] int8; d [N, K/32]; y [M, N]. */
void disagg_q8_0_matmul(const float *x, int64_t m_rows, int64_t k, const int8_t *qs,
                        const float *d, int64_t n, float *y, int threads) {
    columns(x, m_rows, k, n, y, threads, qs, d, NULL, 0, 1);
}

/* The fp32 weights the blocks stand for, out [N, K] (prefill multiplies these by sgemm). */
void disagg_q4_dequant(const uint8_t *qs, const float *d, const float *mn, int zero, int64_t n,
                       int64_t k, float *out, int threads) {
    int64_t ng = k / GROUP;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t c = 0; c < n; c++) q4_expand(qs + c * ng * 16, d + c * ng, mn + c * ng, zero, ng, 1, out + c * k);
}

void disagg_q8_0_dequant(const int8_t *qs, const float *d, int64_t n, int64_t k, float *out,
                         int threads) {
    int64_t ng = k / GROUP;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t c = 0; c < n; c++) q8_expand(qs + c * ng * GROUP, d + c * ng, ng, 1, out + c * k);
}

/* ---------------------------------------------------------------- the rest of a decode step
 * The small operations between the matmuls, one call each for all rows: in torch they are
 * some 30 dispatched ops a layer, ~10 ms of a 25 ms batch-1 step here. Rows are
 * independent in each (batch invariant) and the order of every sum is fixed. */

#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#define THREAD_NUM() omp_get_thread_num()
#else
#define THREAD_NUM() 0
#endif

/* sum a[j] b[j] over n (a multiple of 8): eight lanes, folded at the end */
static inline float dot(const float *a, const float *b, int64_t n) {
#ifdef DISAGG_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), acc);
    return hsum8(acc);
#else
    float lane[8] = {0};
    for (int64_t j = 0; j < n; j++) lane[j % 8] += a[j] * b[j];
    return ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
#endif
}

/* e^x for softmax and SiLU: libm's scalar expf was a tenth of a 16-row step (~1.6M calls).
 * x = n ln2 + f with |f| <= ln2/2, e^f by its degree-6 Taylor polynomial (relative error
 * < 2e-7 there: about one float ulp), times 2^n built in the exponent bits. The vector and
 * scalar forms do the same operations (fma explicit), so a value's result does not depend
 * on whether it fell in a vector or in the tail. Inputs are clamped to [-87, 88]: e^-87 is
 * below every softmax weight and SiLU gate that matters, e^88 below FLT_MAX. */
#define EXP_LO (-87.0f)
#define EXP_HI 88.0f
static const float exp_c[7] = {1.0f, 1.0f, 1.0f / 2, 1.0f / 6, 1.0f / 24, 1.0f / 120, 1.0f / 720};

static inline float exp_s(float x) {
    x = x < EXP_LO ? EXP_LO : x > EXP_HI ? EXP_HI : x;
    float n = nearbyintf(x * 1.44269504f);
    float f = fmaf(n, -0.693145752f, x);  /* ln2 in two parts: n ln2_hi exact */
    f = fmaf(n, -1.42860677e-06f, f);
    float p = exp_c[6];
    for (int i = 5; i >= 0; i--) p = fmaf(p, f, exp_c[i]);
    union { float f; int32_t i; } two = {.i = ((int32_t)n + 127) << 23};
    return p * two.f;
}

#ifdef DISAGG_AVX2
static inline __m256 exp_v(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_LO)), _mm256_set1_ps(EXP_HI));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693145752f), x);
    f = _mm256_fmadd_ps(n, _mm256_set1_ps(-1.42860677e-06f), f);
    __m256 p = _mm256_set1_ps(exp_c[6]);
    for (int i = 5; i >= 0; i--) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(exp_c[i]));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

/* v[i] = e^(v[i] - shift) for i < n */
static void exp_shifted(float *v, int64_t n, float shift) {
    int64_t i = 0;
#ifdef DISAGG_AVX2
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(v + i, exp_v(_mm256_sub_ps(_mm256_loadu_ps(v + i), _mm256_set1_ps(shift))));
#endif
    for (; i < n; i++) v[i] = exp_s(v[i] - shift);
}

/* (the row-wise kernels below split their rows among `threads` from ROWS_APART rows on:
 * prompt rows; a row's arithmetic is the same whichever thread runs it) */
#define ROWS_APART 64

/* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, for r < m_rows. */
void disagg_rms_norm(const float *x, const float *w, int64_t m_rows, int64_t dim, float eps,
                     float *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (m_rows >= ROWS_APART)
    for (int64_t r = 0; r < m_rows; r++) {
        const float *xr = x + r * dim;
        float ss = dot(xr, xr, dim);
        float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        for (int64_t j = 0; j < dim; j++) out[r * dim + j] = xr[j] * inv * w[j];
    }
}

/* RoPE (HF's rotate_half layout; c/s: the position's cos and sin rows, sin's first half
 * negated) on the q and k heads of one row of the fused projection, in place */
static void rope_row(float *row, int64_t heads, int64_t d, const float *c, const float *s) {
    int64_t half = d / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *x = row + h * d;
        float tmp[512];
        for (int64_t j = 0; j < d; j++) tmp[j] = x[j];
        for (int64_t j = 0; j < d; j++) {
            float rot = j < half ? tmp[j + half] : tmp[j - half];
            x[j] = tmp[j] * c[j] + rot * s[j];
        }
    }
}

/* Prompt rows: qkv [M, (H + 2 Hkv) * D], RoPE on the q and k heads in place, row r at the
 * position whose cos and sin rows are cos_r[r], sin_r[r] ([M, D] each) */
void disagg_rope_rows(float *qkv, int64_t m_rows, int64_t n_heads, int64_t n_kv, int64_t d,
                      const float *cos_r, const float *sin_r, int threads) {
    int64_t width = (n_heads + 2 * n_kv) * d;
#pragma omp parallel for schedule(static) num_threads(threads) if (m_rows >= ROWS_APART)
    for (int64_t r = 0; r < m_rows; r++)
        rope_row(qkv + r * width, n_heads + n_kv, d, cos_r + r * d, sin_r + r * d);
}

/* qkv [M, (H + 2 Hkv) * D] from the fused projection: RoPE on the q and k heads in place
 * (cos/sin tables [positions, D]), then k and v written to the layer's cache
 * [slots, Hkv, max_len, D] at (slot r, position pos[r]). */
void disagg_rope_store(float *qkv, int64_t m_rows, int64_t n_heads, int64_t n_kv, int64_t d,
                       const int64_t *pos, const float *cos_t, const float *sin_t,
                       float *kcache, float *vcache, int64_t max_len) {
    int64_t width = (n_heads + 2 * n_kv) * d;
    for (int64_t r = 0; r < m_rows; r++) {
        float *row = qkv + r * width;
        rope_row(row, n_heads + n_kv, d, cos_t + pos[r] * d, sin_t + pos[r] * d);
        for (int64_t h = 0; h < n_kv; h++) {
            int64_t at = ((r * n_kv + h) * max_len + pos[r]) * d;
            memcpy(kcache + at, row + (n_heads + h) * d, (size_t)d * sizeof(float));
            memcpy(vcache + at, row + (n_heads + n_kv + h) * d, (size_t)d * sizeof(float));
        }
    }
}

#define AG 4 /* query heads of one kv head attended together (AVX2) */

/* p[0..t) /= sum (one vector division rounds as eight scalar ones) */
static void normalize(float *p, int64_t t, float sum) {
    int64_t i = 0;
#ifdef DISAGG_AVX2
    __m256 s8 = _mm256_set1_ps(sum);
    for (; i + 8 <= t; i += 8) _mm256_storeu_ps(p + i, _mm256_div_ps(_mm256_loadu_ps(p + i), s8));
#endif
    for (; i < t; i++) p[i] = p[i] / sum;
}

#ifdef DISAGG_AVX2
/* NG heads' outputs o_g (d apart) = the weighted sum of the rows of v [t, d], position by
 * position: o_g += p_g[i] v_i (a multiply, then an add; p_g: NG weight rows ld apart).
 * Each row of v is read once for all NG heads. */
static inline __attribute__((always_inline)) void weigh(const float *p, int64_t ld, const int NG,
                                                        int64_t t, const float *v, int64_t d,
                                                        float *o, int64_t j) {
    /* (from element j on: those before j are the caller's) */
    for (; j + 32 <= d; j += 32) { /* 32 of each head's o in registers over all the positions */
        __m256 acc[AG][4];
        for (int g = 0; g < NG; g++)
            for (int u = 0; u < 4; u++) acc[g][u] = _mm256_setzero_ps();
        for (int64_t i = 0; i < t; i++) {
            const float *vi = v + i * d + j;
            __m256 vv[4];
            for (int u = 0; u < 4; u++) vv[u] = _mm256_loadu_ps(vi + 8 * u);
            for (int g = 0; g < NG; g++) {
                __m256 w = _mm256_set1_ps(p[g * ld + i]);
                for (int u = 0; u < 4; u++)
                    acc[g][u] = _mm256_add_ps(acc[g][u], _mm256_mul_ps(w, vv[u]));
            }
        }
        for (int g = 0; g < NG; g++)
            for (int u = 0; u < 4; u++) _mm256_storeu_ps(o + g * d + j + 8 * u, acc[g][u]);
    }
    for (; j < d; j += 8) {
        __m256 acc[AG];
        for (int g = 0; g < NG; g++) acc[g] = _mm256_setzero_ps();
        for (int64_t i = 0; i < t; i++) {
            __m256 vv = _mm256_loadu_ps(v + i * d + j);
            for (int g = 0; g < NG; g++)
                acc[g] = _mm256_add_ps(acc[g], _mm256_mul_ps(_mm256_set1_ps(p[g * ld + i]), vv));
        }
        for (int g = 0; g < NG; g++) _mm256_storeu_ps(o + g * d + j, acc[g]);
    }
}
#else
static void weigh(const float *p, int64_t ld, int ng, int64_t t, const float *v, int64_t d,
                  float *o, int64_t j0) {
    for (int g = 0; g < ng; g++) {
        float *og = o + g * d;
        for (int64_t j = j0; j < d; j++) og[j] = 0.0f;
        for (int64_t i = 0; i < t; i++)
            for (int64_t j = j0; j < d; j++) og[j] += p[g * ld + i] * v[i * d + j];
    }
}
#endif

/* the largest of p[0..t), NaNs passed over (the same value in any order) */
static inline float max_of(const float *p, int64_t t) {
    float mx = -INFINITY;
    int64_t i = 0;
#ifdef DISAGG_AVX2
    __m256 m8 = _mm256_set1_ps(-INFINITY);
    /* (maxps returns its second operand where either is NaN: the running maximum, as the
     * scalar comparison below keeps it) */
    for (; i + 8 <= t; i += 8) m8 = _mm256_max_ps(_mm256_loadu_ps(p + i), m8);
    float lane[8];
    _mm256_storeu_ps(lane, m8);
    for (int u = 0; u < 8; u++) mx = lane[u] > mx ? lane[u] : mx;
#endif
    for (; i < t; i++) mx = p[i] > mx ? p[i] : mx;
    return mx;
}

#ifdef DISAGG_AVX2
/* p[g * ld + i] = dot(q_g, k_i) * scale for NG query heads: each dot dot()'s own chain of
 * fmas and fold, 2 NG of them in flight (two positions a pass) instead of one. The values'
 * rows (pv) are requested as their keys are read: one stream alone left half the memory
 * bandwidth unused (a 16-sequence step's attention 10.4 -> 7.4 ms here). */
static inline __attribute__((always_inline)) void scores(const float *q, int64_t d, const int NG,
                                                         const float *k, int64_t t, float scale,
                                                         float *p, int64_t ld, const float *pv) {
    int64_t i = 0;
    for (; i + 2 <= t; i += 2) {
        __m256 acc[AG][2];
        for (int g = 0; g < NG; g++) acc[g][0] = acc[g][1] = _mm256_setzero_ps();
        const float *k0 = k + i * d, *k1 = k0 + d;
        for (int64_t j = 0; j < 2 * d; j += 16) /* these positions' values, for weigh() */
            _mm_prefetch((const char *)(pv + i * d + j), _MM_HINT_T0);
        for (int64_t j = 0; j < d; j += 8) {
            __m256 a = _mm256_loadu_ps(k0 + j), b = _mm256_loadu_ps(k1 + j);
            for (int g = 0; g < NG; g++) {
                __m256 qv = _mm256_loadu_ps(q + g * d + j);
                acc[g][0] = _mm256_fmadd_ps(qv, a, acc[g][0]);
                acc[g][1] = _mm256_fmadd_ps(qv, b, acc[g][1]);
            }
        }
        for (int g = 0; g < NG; g++) {
            p[g * ld + i] = hsum8(acc[g][0]) * scale;
            p[g * ld + i + 1] = hsum8(acc[g][1]) * scale;
        }
    }
    for (; i < t; i++)
        for (int g = 0; g < NG; g++) p[g * ld + i] = dot(q + g * d, k + i * d, d) * scale;
}
#endif

#ifdef DISAGG_AVX2
#define STEP AG /* query heads of a kv head an item of the attention loops takes */
#else
#define STEP 1
#endif

/* Each of G score rows (ld apart) made its softmax in place: e^(score - max), then its sum,
 * in position order, then the division. Rows g < NG0 hold t positions, the others t + more
 * (more 1: a second prompt row, one position on: attend_pair). The rows' sums advance
 * together (one chain of t dependent adds per head was a quarter of a long prompt's
 * attention, waiting on each add); a row's last position is its sum's last add. */
static inline __attribute__((always_inline)) void softmax_rows(float *p, int64_t ld, const int G,
                                                               const int NG0, int64_t t,
                                                               const int more) {
    float sum[2 * AG] = {0.0f};
    for (int g = 0; g < G; g++) {
        int64_t tg = g < NG0 ? t : t + more;
        exp_shifted(p + g * ld, tg, max_of(p + g * ld, tg));
    }
    for (int64_t i = 0; i < t; i++)
        for (int g = 0; g < G; g++) sum[g] += p[g * ld + i];
    for (int g = NG0; g < G && more; g++) sum[g] += p[g * ld + t];
    for (int g = 0; g < G; g++) normalize(p + g * ld, g < NG0 ? t : t + more, sum[g]);
}

#if defined(DISAGG_AVX2) && defined(__AVX512F__)
#define KEY_BLOCKS 1
#include "prompt_keys.h" /* prompt rows score against blocks of keys, 16 lanes wide */
#endif

/* NG (<= STEP) query heads of one kv head (q: theirs, d apart) attend over positions 0..t-1
 * of its keys and values k, v [t, d]: scores into p (NG rows ld apart), the heads' outputs
 * into out (d apart). Every output is the same sequence of operations whatever NG and ld are:
 * a row's result depends on its query, its position and the cache alone. */
static inline __attribute__((always_inline)) void attend_n(const float *q, const int NG,
                                                           const float *k, const float *kt,
                                                           const float *v, int64_t t, int64_t d,
                                                           float scale, float *p, int64_t ld,
                                                           float *out) {
#ifdef KEY_BLOCKS
    if (kt)
        blocks_scores(q, d, NG, kt, t, scale, p, ld);
    else
        scores(q, d, NG, k, t, scale, p, ld, v);
#elif defined(DISAGG_AVX2)
    (void)kt;
    scores(q, d, NG, k, t, scale, p, ld, v);
#else
    (void)kt;
    for (int g = 0; g < NG; g++)
        for (int64_t i = 0; i < t; i++) p[g * ld + i] = dot(q + g * d, k + i * d, d) * scale;
#endif
    softmax_rows(p, ld, NG, NG, t, 0);
#ifdef KEY_BLOCKS
    weigh16(p, ld, NG, NG, t, v, d, out, NULL); /* (decode rows too: weigh's bits) */
#else
    weigh(p, ld, NG, t, v, d, out, 0);
#endif
}

/* attend_n for ng heads, NG made a constant for the compiler (registers, unrolling) */
static void attend(const float *q, int64_t ng, const float *k, const float *kt, const float *v,
                   int64_t t, int64_t d, float scale, float *p, int64_t ld, float *out) {
    switch (ng) {
    case 1: attend_n(q, 1, k, kt, v, t, d, scale, p, ld, out); break;
    case 2: attend_n(q, 2, k, kt, v, t, d, scale, p, ld, out); break;
    case 3: attend_n(q, 3, k, kt, v, t, d, scale, p, ld, out); break;
    default: attend_n(q, 4, k, kt, v, t, d, scale, p, ld, out); break;
    }
}

/* out [M, H * D]: row r's query heads (grouped by kv head) attend over positions 0..pos[r]
 * of its own cache slot. With AVX2 a kv head's query heads are scored together (its keys
 * read once for all of them); every output is the same sequence of operations either way. */
void disagg_decode_attention(const float *qkv, int64_t m_rows, int64_t n_heads, int64_t n_kv,
                             int64_t d, const int64_t *pos, const float *kcache,
                             const float *vcache, int64_t max_len, float scale, float *out,
                             float *scratch, int threads) {
    int64_t width = (n_heads + 2 * n_kv) * d, group = n_heads / n_kv, step = STEP;
    int64_t runs = (group + step - 1) / step; /* runs of query heads a kv head's are taken in */
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t item = 0; item < m_rows * n_kv * runs; item++) {
        int64_t r = item / (n_kv * runs), kh = item / runs % n_kv, g0 = item % runs * step;
        int64_t ng = group - g0 < step ? group - g0 : step, h0 = kh * group + g0;
        int64_t at = (r * n_kv + kh) * max_len * d;
        attend(qkv + r * width + h0 * d, ng, kcache + at, NULL, vcache + at, pos[r] + 1, d,
               scale, scratch + (r * n_heads + h0) * max_len, max_len,
               out + (r * n_heads + h0) * d);
    }
}

/* whether prompt rows take the key blocks (prompt_keys.h) in this build */
int disagg_prompt_key_blocks(void) {
#ifdef KEY_BLOCKS
    return 1;
#else
    return 0;
#endif
}

/* floats of disagg_prompt_attention's scratch: each thread's score rows (2 STEP of start +
 * M, room for two rows' heads), then with KEY_BLOCKS each kv head's keys in blocks */
int64_t disagg_prompt_scratch(int64_t m_rows, int64_t start, int64_t n_kv, int64_t d,
                              int threads) {
    int64_t t = start + m_rows, rows = (int64_t)threads * 2 * STEP * t;
#ifdef KEY_BLOCKS
    rows += n_kv * ((t + KB - 1) / KB * KB) * d;
#else
    (void)n_kv, (void)d;
#endif
    return rows;
}

/* Prompt rows of one sequence: row r of q (rows q_ld floats apart, a row's heads d apart)
 * sits at position start + r and attends over positions 0..start + r of k, v (kv head kh at
 * kh * kv_ld * d, its positions d apart), with disagg_decode_attention's operations for a
 * row at that position: a prompt's rows get the same bits whole, in chunks of any size,
 * after a cached prefix, or as decode steps. out [M, H * D]; scratch: disagg_prompt_scratch
 * floats; key_blocks 0: the keys as they lie, as decode reads them (the same bits, slower:
 * for benchmarks and tests). A kv head's rows are dealt out in turn (a row's work grows with
 * its position), so the threads read the same keys at the same time. */
void disagg_prompt_attention(const float *q, int64_t q_ld, int64_t m_rows, int64_t start,
                             int64_t n_heads, int64_t n_kv, int64_t d, const float *k,
                             const float *v, int64_t kv_ld, float scale, float *out,
                             float *scratch, int threads, int key_blocks) {
    int64_t group = n_heads / n_kv, step = STEP, runs = (group + step - 1) / step;
    int64_t ld = start + m_rows;
    float *kt = NULL; /* the keys in blocks (prompt_keys.h), kt_head floats a kv head */
    int64_t kt_head = 0;
#ifdef KEY_BLOCKS
    key_blocks = key_blocks && m_rows >= KB_ROWS;
    int64_t blocks = key_blocks ? (ld + KB - 1) / KB : 0;
    if (key_blocks) kt = scratch + (int64_t)threads * 2 * step * ld, kt_head = blocks * KB * d;
#else
    (void)key_blocks;
#endif
    /* rows an item takes: two where they can attend as a pair (attend_pair), else one */
    int64_t per = kt && d % 64 == 0 ? 2 : 1, items = (m_rows + per - 1) / per;
#pragma omp parallel num_threads(threads)
    {
#ifdef KEY_BLOCKS
#pragma omp for schedule(static)
        for (int64_t item = 0; item < n_kv * blocks; item++)
            key_block(k + item / blocks * kv_ld * d, ld, d, item % blocks,
                      kt + item / blocks * kt_head);
#endif
#pragma omp for schedule(static, 1)
        for (int64_t item = 0; item < n_kv * runs * items; item++) {
            int64_t r = item % items * per, kh = item / items / runs;
            int64_t g0 = item / items % runs * step;
            int64_t ng = group - g0 < step ? group - g0 : step, h0 = kh * group + g0;
            float *p = scratch + (int64_t)THREAD_NUM() * 2 * step * ld;
            const float *qr = q + r * q_ld + h0 * d, *vh = v + kh * kv_ld * d;
            float *o = out + (r * n_heads + h0) * d;
#ifdef KEY_BLOCKS
            if (per == 2 && r + 1 < m_rows && ng <= KH) { /* rows r and r + 1 */
                attend_pair(qr, qr + q_ld, ng, kt + kh * kt_head, vh, start + r + 1, d, scale, p,
                            ld, o, o + n_heads * d);
                continue;
            }
#endif
            for (int64_t row = r; row < r + per && row < m_rows; row++)
                attend(qr + (row - r) * q_ld, ng, k + kh * kv_ld * d, kt ? kt + kh * kt_head : NULL,
                       vh, start + row + 1, d, scale, p, ld, o + (row - r) * n_heads * d);
        }
    }
}

/* out[r, j] = silu(gu[r, j]) * gu[r, hidden + j]: the gate and up halves of the fused w13. */
void disagg_silu_mul(const float *gu, int64_t m_rows, int64_t hidden, float *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (m_rows >= ROWS_APART)
    for (int64_t r = 0; r < m_rows; r++) {
        const float *g = gu + r * 2 * hidden, *u = g + hidden;
        float *o = out + r * hidden;
        for (int64_t j = 0; j < hidden; j++) o[j] = -g[j];
        exp_shifted(o, hidden, 0.0f);
        for (int64_t j = 0; j < hidden; j++) o[j] = g[j] / (1.0f + o[j]) * u[j];
    }
}
