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
 * more rows expand two columns at a time into a per-thread buffer (L1) and run a 4x2
 * register tile over it, so a column's blocks are read from memory once whatever M is.
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

/* acc[r] += w . x[r] over one group (four 8-lane segments), r < nr. */
static inline void group_fma(__m256 acc[ROWS], const float *x, int64_t k, int64_t nr,
                             __m256 w0, __m256 w1, __m256 w2, __m256 w3) {
    for (int64_t r = 0; r < nr; r++) {
        const float *p = x + r * k;
        acc[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(p), acc[r]);
        acc[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(p + 8), acc[r]);
        acc[r] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(p + 16), acc[r]);
        acc[r] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(p + 24), acc[r]);
    }
}

static inline __m256 expand8(__m128i q8, __m256 dg, __m256 mg) {
    /* d * q + m, rounded twice like the scalar expansion */
    return _mm256_add_ps(_mm256_mul_ps(dg, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8))), mg);
}

/* One Q4 column against nr <= ROWS rows, expanded in registers. */
static void q4_column(const float *x, int64_t k, int64_t nr, const uint8_t *qs, const float *d,
                      const float *mn, int zero, float *y, int64_t ldy) {
    __m256 acc[ROWS];
    for (int r = 0; r < ROWS; r++) acc[r] = _mm256_setzero_ps();
    const __m128i low4 = _mm_set1_epi8(0x0F), z = _mm_set1_epi8((char)zero);
    for (int64_t g = 0; g < k / GROUP; g++) {
        __m128i b = _mm_loadu_si128((const __m128i *)(qs + g * 16));
        __m128i lo = _mm_sub_epi8(_mm_and_si128(b, low4), z);
        __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(b, 4), low4), z);
        __m256 dg = _mm256_set1_ps(d[g]), mg = _mm256_set1_ps(mn[g]);
        group_fma(acc, x + g * GROUP, k, nr, expand8(lo, dg, mg),
                  expand8(_mm_srli_si128(lo, 8), dg, mg), expand8(hi, dg, mg),
                  expand8(_mm_srli_si128(hi, 8), dg, mg));
    }
    for (int64_t r = 0; r < nr; r++) y[r * ldy] = hsum8(acc[r]);
}

static void q8_column(const float *x, int64_t k, int64_t nr, const int8_t *qs, const float *d,
                      float *y, int64_t ldy) {
    __m256 acc[ROWS];
    for (int r = 0; r < ROWS; r++) acc[r] = _mm256_setzero_ps();
    const __m256 zero = _mm256_setzero_ps();
    for (int64_t g = 0; g < k / GROUP; g++) {
        const __m128i *q = (const __m128i *)(qs + g * GROUP);
        __m128i a = _mm_loadu_si128(q), b = _mm_loadu_si128(q + 1);
        __m256 dg = _mm256_set1_ps(d[g]);
        /* d * q is exact in fp32 (11 x 8 significant bits): + 0 changes nothing */
        group_fma(acc, x + g * GROUP, k, nr, expand8(a, dg, zero),
                  expand8(_mm_srli_si128(a, 8), dg, zero), expand8(b, dg, zero),
                  expand8(_mm_srli_si128(b, 8), dg, zero));
    }
    for (int64_t r = 0; r < nr; r++) y[r * ldy] = hsum8(acc[r]);
}

/* Rows r0 .. r0+nr-1 (nr <= ROWS) against nc <= 2 expanded columns w [nc, k]. */
static void tile(const float *x, int64_t k, int64_t nr, const float *w, int64_t nc, float *y,
                 int64_t ldy) {
    __m256 acc[ROWS][2];
    for (int r = 0; r < ROWS; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const float *w1 = nc > 1 ? w + k : w;
    for (int64_t j = 0; j < k; j += 8) {
        __m256 a = _mm256_loadu_ps(w + j), b = _mm256_loadu_ps(w1 + j);
        for (int64_t r = 0; r < nr; r++) {
            __m256 xv = _mm256_loadu_ps(x + r * k + j);
            acc[r][0] = _mm256_fmadd_ps(a, xv, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(b, xv, acc[r][1]);
        }
    }
    for (int64_t r = 0; r < nr; r++)
        for (int64_t c = 0; c < nc; c++) y[r * ldy + c] = hsum8(acc[r][c]);
}
#else
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

/* Columns split among the threads in pairs; each pair expanded once (in registers for up to
 * ROWS rows, else into buf) and multiplied with every row. */
static void columns(const float *x, int64_t m_rows, int64_t k, int64_t n, float *y,
                    int threads, const void *qs, const float *d, const float *mn, int zero,
                    int q8) {
    int64_t ng = k / GROUP, width = q8 ? GROUP : 16;
#pragma omp parallel num_threads(threads)
    {
        float buf[2 * k];
#pragma omp for schedule(static)
        for (int64_t c = 0; c < n; c += 2) {
            int64_t nc = n - c < 2 ? n - c : 2;
            const uint8_t *qc = (const uint8_t *)qs + c * ng * width;
#ifdef DISAGG_AVX2
            if (m_rows <= ROWS) {
                for (int64_t i = 0; i < nc; i++) {
                    if (q8)
                        q8_column(x, k, m_rows, (const int8_t *)qc + i * ng * GROUP,
                                  d + (c + i) * ng, y + c + i, n);
                    else
                        q4_column(x, k, m_rows, qc + i * ng * 16, d + (c + i) * ng,
                                  mn + (c + i) * ng, zero, y + c + i, n);
                }
                continue;
            }
#endif
            if (q8)
                q8_expand((const int8_t *)qc, d + c * ng, ng, nc, buf);
            else
                q4_expand(qc, d + c * ng, mn + c * ng, zero, ng, nc, buf);
            for (int64_t r0 = 0; r0 < m_rows; r0 += ROWS) {
                int64_t nr = m_rows - r0 < ROWS ? m_rows - r0 : ROWS;
                tile(x + r0 * k, k, nr, buf, nc, y + r0 * n + c, n);
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
