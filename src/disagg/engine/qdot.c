/* Matrix products with GGUF block-quantized weights and int8-quantized activations: the
 * integer path beside qmatmul.c's fp32 one (engine/quant.py compiles both into one library).
 *
 *   y[M, N] = x[M, K] @ W[N, K]^T, W in the checkpoint's blocks of 32 (see qmatmul.c), and
 *   each row of x quantized per group of 32 the way llama.cpp's Q8_1 does:
 *     dx = max|x_j| / 127,  qx_j = round(x_j / dx) in -127..127,  sx = dx * sum_j qx_j
 *   so that a group's dot product is exact integer arithmetic plus two products:
 *     Q4_1  sum_j (d q_j + m) dx qx_j = d dx * sum_j q_j qx_j + m sx
 *     Q4_0  w = d (q - 8):               d dx * sum_j q_j qx_j - 8 d sx
 *     Q8_0  w = d q:                     d dx * sum_j q_j qx_j
 *
 * Why: expanding every weight to fp32 (qmatmul.c) costs ~12 vector operations a group for
 * each column, and per row 4 fma; here a group costs a few byte operations a column and per
 * row one maddubs + one madd + one convert + one fma. At one row that moves the step from
 * expanding weights to reading them; at 16 rows from fp32 fma to int8 multiply-adds.
 *
 * What it changes: the activations lose precision (8 bits a value with a scale per 32,
 * as in llama.cpp); the weights are still exactly the checkpoint's. Perplexity and greedy
 * replies against the fp32 path are measured by benchmarks/weights_bench.py and tested.
 *
 * Batch invariant by construction, as qmatmul.c: a row is quantized alone, and its
 * (row, column) result is one fixed sequence of operations whatever the other rows are;
 * each output is computed by exactly one thread (OpenMP: torch's own libgomp).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define QDOT_AVX2 1
#endif

#define GROUP 32
#define ROWS 4 /* rows sharing one unpacking of a column pair in registers */

enum { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2 }; /* quant.FORMATS' order */

/* Each row's groups: qx [K] int8, dx and sx [K/32]. The SIMD and scalar forms give the same
 * bytes: the scale is one division, the quotient one multiply, rounding half to even. */
static void quantize_rows(const float *x, int64_t m_rows, int64_t k, int8_t *qx, float *dx,
                          float *sx) {
    int64_t ng = k / GROUP;
    for (int64_t i = 0; i < m_rows * ng; i++) {
        const float *v = x + i * GROUP;
#ifdef QDOT_AVX2
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 f[4], mx = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            f[j] = _mm256_loadu_ps(v + 8 * j);
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, f[j]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 0x55));
        float d = _mm_cvtss_f32(m4) / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        __m256 idv = _mm256_set1_ps(id);
        __m256i q[4], sum = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            __m256 r = _mm256_round_ps(_mm256_mul_ps(f[j], idv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            q[j] = _mm256_cvtps_epi32(r);
            sum = _mm256_add_epi32(sum, q[j]);
        }
        /* packs work per 128-bit lane: the permute puts the 32 bytes back in order */
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(qx + i * GROUP), p);
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
        int total = _mm_cvtsi128_si32(s4);
#else
        float amax = 0.0f;
        for (int j = 0; j < GROUP; j++) amax = fmaxf(amax, fabsf(v[j]));
        float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        int total = 0;
        for (int j = 0; j < GROUP; j++) {
            int q = (int)nearbyintf(v[j] * id);
            qx[i * GROUP + j] = (int8_t)q;
            total += q;
        }
#endif
        dx[i] = d;
        sx[i] = d * (float)total;
    }
}

/* The quantized rows, for the tests: the same bytes the product uses. */
void disagg_qdot_quantize(const float *x, int64_t m_rows, int64_t k, int8_t *qx, float *dx,
                          float *sx) {
    quantize_rows(x, m_rows, k, qx, dx, sx);
}

#ifdef QDOT_AVX2
static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    __m128 s = _mm_add_ps(lo, hi);
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 0x55));
    return _mm_cvtss_f32(s);
}

#define INLINE static inline __attribute__((always_inline))

/* A group's 32 weights of a 4-bit column as bytes 0..15 in weight order. */
INLINE __m256i unpack4(const uint8_t *qs) {
    const __m128i low4 = _mm_set1_epi8(0x0F);
    __m128i b = _mm_loadu_si128((const __m128i *)qs);
    __m128i lo = _mm_and_si128(b, low4), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4);
    return _mm256_set_m128i(hi, lo);
}

/* 8 int32 partial sums of w_j * x_j, as floats; w unsigned bytes (4-bit formats) or, for
 * Q8_0, signed ones (|w| and x with w's sign: maddubs wants one operand unsigned). No
 * overflow: |pair| <= 2 * 128 * 127 < 2^15. */
INLINE __m256 dot32(__m256i w, __m256i xv, const int fmt) {
    __m256i p = fmt == Q8_0 ? _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w))
                            : _mm256_maddubs_epi16(w, xv);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}

/* sum_g a[g] s[g] over n groups: eight lanes, folded as hsum8, then the tail in order. */
INLINE float gdot(const float *a, const float *s, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= n; g += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + g), _mm256_loadu_ps(s + g), acc);
    float t = hsum8(acc);
    for (; g < n; g++) t = fmaf(a[g], s[g], t);
    return t;
}

/* Columns c0, c1 (c1 may repeat c0: then only c0 is written) against NR <= ROWS rows. The
 * per-group scales d_w dx are multiplied up front (one rounding each, as inline), and the
 * additive term (m or -8 d against sx) is one dot product a (row, column) after the loop. */
INLINE void ipair(const int8_t *qx, const float *dx, const float *sx, int64_t k, const int NR,
                  const uint8_t *q0, const uint8_t *q1, const float *d0, const float *d1,
                  const float *m0, const float *m1, const int fmt, int64_t nc, float *y,
                  int64_t ldy) {
    int64_t ng = k / GROUP, width = fmt == Q8_0 ? GROUP : 16;
    float scale[ROWS][2][ng];
    __m256 acc[ROWS][2];
    for (int r = 0; r < NR; r++) {
        acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        for (int64_t g = 0; g < ng; g++) {
            scale[r][0][g] = d0[g] * dx[r * ng + g];
            scale[r][1][g] = d1[g] * dx[r * ng + g];
        }
    }
    for (int64_t g = 0; g < ng; g++) {
        __m256i w0, w1;
        if (fmt == Q8_0) {
            w0 = _mm256_loadu_si256((const __m256i *)(q0 + g * width));
            w1 = _mm256_loadu_si256((const __m256i *)(q1 + g * width));
        } else {
            w0 = unpack4(q0 + g * width), w1 = unpack4(q1 + g * width);
        }
        for (int r = 0; r < NR; r++) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(qx + r * k + g * GROUP));
            acc[r][0] = _mm256_fmadd_ps(_mm256_broadcast_ss(&scale[r][0][g]), dot32(w0, xv, fmt), acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(_mm256_broadcast_ss(&scale[r][1][g]), dot32(w1, xv, fmt), acc[r][1]);
        }
    }
    for (int r = 0; r < NR; r++) {
        for (int64_t c = 0; c < nc; c++) {
            const float *a = c ? m1 : m0, *dd = c ? d1 : d0;
            float add = fmt == Q4_1 ? gdot(a, sx + r * ng, ng)
                        : fmt == Q4_0 ? -8.0f * gdot(dd, sx + r * ng, ng) : 0.0f;
            y[r * ldy + c] = hsum8(acc[r][c]) + add;
        }
    }
}

#define IPAIR(NR, F) ipair(qx, dx, sx, k, NR, q0, q1, d0, d1, m0, m1, F, nc, y, ldy)
static void rows_pair(const int8_t *qx, const float *dx, const float *sx, int64_t k, int64_t nr,
                      const uint8_t *q0, const uint8_t *q1, const float *d0, const float *d1,
                      const float *m0, const float *m1, int fmt, int64_t nc, float *y,
                      int64_t ldy) {
    /* every (rows, format) its own copy: constants unroll the rows and drop the tests */
    switch (nr * 3 + fmt) {
    case 3: IPAIR(1, Q4_0); break;
    case 4: IPAIR(1, Q4_1); break;
    case 5: IPAIR(1, Q8_0); break;
    case 6: IPAIR(2, Q4_0); break;
    case 7: IPAIR(2, Q4_1); break;
    case 8: IPAIR(2, Q8_0); break;
    case 9: IPAIR(3, Q4_0); break;
    case 10: IPAIR(3, Q4_1); break;
    case 11: IPAIR(3, Q8_0); break;
    case 12: IPAIR(4, Q4_0); break;
    case 13: IPAIR(4, Q4_1); break;
    default: IPAIR(4, Q8_0); break;
    }
}
#undef IPAIR
#else
/* Portable fallback: the SIMD path's operations in its order (integer sums exact; lane l of
 * a group holds its weights 4l..4l+3, as maddubs + madd leave them), so the same bits. */
static float fold8(const float l[8]) {
    return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

static float gdot(const float *a, const float *s, int64_t n) {
    float lane[8] = {0};
    int64_t g = 0;
    for (; g + 8 <= n; g += 8)
        for (int l = 0; l < 8; l++) lane[l] = fmaf(a[g + l], s[g + l], lane[l]);
    float t = fold8(lane);
    for (; g < n; g++) t = fmaf(a[g], s[g], t);
    return t;
}

static void rows_pair(const int8_t *qx, const float *dx, const float *sx, int64_t k, int64_t nr,
                      const uint8_t *q0, const uint8_t *q1, const float *d0, const float *d1,
                      const float *m0, const float *m1, int fmt, int64_t nc, float *y,
                      int64_t ldy) {
    int64_t ng = k / GROUP, width = fmt == Q8_0 ? GROUP : 16;
    for (int64_t r = 0; r < nr; r++) {
        for (int64_t c = 0; c < nc; c++) {
            const uint8_t *q = c ? q1 : q0;
            const float *d = c ? d1 : d0, *mn = c ? m1 : m0;
            float lane[8] = {0};
            for (int64_t g = 0; g < ng; g++) {
                const uint8_t *b = q + g * width;
                int32_t part[8] = {0};
                for (int j = 0; j < GROUP; j++) {
                    int w = fmt == Q8_0 ? (int)(int8_t)b[j] : (j < 16 ? b[j] & 0x0F : b[j - 16] >> 4);
                    part[j / 4] += w * qx[r * k + g * GROUP + j];
                }
                float sc = d[g] * dx[r * ng + g];
                for (int l = 0; l < 8; l++) lane[l] = fmaf(sc, (float)part[l], lane[l]);
            }
            float add = fmt == Q4_1 ? gdot(mn, sx + r * ng, ng)
                        : fmt == Q4_0 ? -8.0f * gdot(d, sx + r * ng, ng) : 0.0f;
            y[r * ldy + c] = fold8(lane) + add;
        }
    }
}
#endif

/* x [M, K] fp32; W: qs [N, K/32, 16] uint8 (fmt 0 Q4_0, 1 Q4_1) or [N, K/32, 32] int8
 * (fmt 2 Q8_0), d and mn [N, K/32] fp32; y [M, N] fp32. Returns -1 where the scratch for
 * the quantized rows cannot be allocated, else 0. */
int disagg_qdot_matmul(const float *x, int64_t m_rows, int64_t k, const uint8_t *qs,
                       const float *d, const float *mn, int fmt, int64_t n, float *y,
                       int threads) {
    int64_t ng = k / GROUP, width = fmt == Q8_0 ? GROUP : 16;
    int8_t *qx = malloc((size_t)(m_rows * k));
    float *dx = malloc((size_t)(m_rows * ng) * sizeof(float) * 2);
    if (!qx || !dx) {
        free(qx), free(dx);
        return -1;
    }
    float *sx = dx + m_rows * ng;
    quantize_rows(x, m_rows, k, qx, dx, sx);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t c = 0; c < n; c += 2) {
        int64_t nc = n - c < 2 ? n - c : 2, c1 = nc > 1 ? c + 1 : c;
        const uint8_t *q0 = qs + c * ng * width, *q1 = qs + c1 * ng * width;
        const float *m0 = mn ? mn + c * ng : d, *m1 = mn ? mn + c1 * ng : d;
        for (int64_t r0 = 0; r0 < m_rows; r0 += ROWS) {
            int64_t nr = m_rows - r0 < ROWS ? m_rows - r0 : ROWS;
            rows_pair(qx + r0 * k, dx + r0 * ng, sx + r0 * ng, k, nr, q0, q1, d + c * ng,
                      d + c1 * ng, m0, m1, fmt, nc, y + r0 * n + c, n);
        }
    }
    free(qx), free(dx);
    return 0;
}
