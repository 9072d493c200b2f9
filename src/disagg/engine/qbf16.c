/* Matrix products with GGUF block-quantized weights in bf16 arithmetic: the third path beside
 * qmatmul.c (fp32) and qdot.c (int8 activations); engine/quant.py compiles all three into one
 * library.
 *
 *   y[M, N] = x[M, K] @ W[N, K]^T, W in the checkpoint's blocks of 32 (see qmatmul.c), with
 *     x_j rounded to bf16 (nearest even) once per row,
 *     w_j = bf16(d q_j + m), the fp32 weight qmatmul.c multiplies, rounded to bf16,
 *   and the products summed in fp32 by vdpbf16ps (AVX512-BF16): lane i of a 16-lane
 *   accumulator takes the pair (2i, 2i+1) of every group of 32, then the lanes are folded
 *   in a fixed order.
 *
 * Why: at 16 decode rows the fp32 block products are bound by multiply-adds (~125 GFLOP/s
 * on two Zen4 cores, about half of fp32's peak); vdpbf16ps does two products a lane per
 * instruction, and a Q4 group's 32 weights become bf16 with one table lookup (vpermw over
 * the group's 16 possible values) instead of four converts, multiplies and adds.
 *
 * What it changes: both factors lose precision (8 significant bits: what a bf16 checkpoint
 * served in bf16 multiplies, as vLLM does by default on such CPUs); sums stay fp32. Greedy
 * replies and perplexity against the fp32 path are measured (benchmarks/weights_bench.py)
 * and tested. It is opt-in (decode_activations bfloat16).
 *
 * One arithmetic, two implementations: the portable one below spells out what the
 * instruction does (products exact in fp32, then two adds, each rounded to nearest even,
 * the odd element of a pair first; denormal inputs and results flushed to zero, as the
 * instruction does), and tests/unit/test_qbf16_kernels.py holds the vector path to it bit
 * for bit.
 * The portable path is what a CPU without AVX512-BF16 would run (slowly: the engine refuses
 * the setting there). Batch invariant by construction, as qmatmul.c: every (row, column) is
 * one fixed sequence of operations whatever the other rows are, computed by one thread. *
 * Rows on tiles (`flags` TILES: every caller in the engine sets it) run on AMX where the CPU
 * has them (tdpbf16ps: 16 rows x 32 bf16 against 16 pairs x 16 columns per instruction; from
 * 64 rows up 3.5-6x the lanes' products here, at 16 decode rows 2.4-3.3x, at 1 row 0.7-0.8x).
 * Same bf16 factors; the tile unit sums each instruction's 32 products in an order of its own
 * that Intel does not spell out, so that path has no bit-for-bit reference: the tests hold it
 * within fp32 summation error of the exact sum of the bf16 products, and batch invariant
 * (each (row, column) is accumulated apart, by the same instructions in either tile layout),
 * so a prompt's K/V are the same in any chunking, cached or cold, and a decode row's logits
 * the same in any batch. Without AMX, TILES changes nothing.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define QBF16_SIMD 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define QBF16_AMX 1
#endif
#endif

#define GROUP 32
#define FEW 32 /* AMX: at most this many rows (two tiles of 16) take amx_few below */
#define RT 4 /* rows of a register tile */
#define CT 6 /* columns of a register tile: 24 accumulators, 6 weights, 1 of x (32 zmm) */

enum { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2 }; /* quant.FORMATS' order */

int disagg_qbf16_simd(void) {
#ifdef QBF16_SIMD
    return 1;
#else
    return 0;
#endif
}

/* Whether rows run on AMX: built for it, and the kernel lets this process use the tile
 * data (Linux asks each process to request it once: arch_prctl ARCH_REQ_XCOMP_PERM). */
int disagg_qbf16_amx(void) {
#ifdef QBF16_AMX
    static int ready = -1; /* (two threads asking at once both get the same answer) */
    if (ready < 0) ready = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                   18 /* XFEATURE_XTILEDATA */) == 0;
    return ready;
#else
    return 0;
#endif
}

static inline uint32_t bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* fp32 -> bf16 as vcvtneps2bf16: nearest even; a denormal input gives a signed zero */
static inline uint16_t to_bf16(float f) {
    uint32_t u = bits(f);
    if ((u & 0x7F800000u) == 0) return (uint16_t)((u >> 16) & 0x8000u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x0040u); /* quiet NaN */
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline float flush(float f) { /* denormal -> signed zero */
    uint32_t u = bits(f);
    return (u & 0x7F800000u) == 0 ? from_bits(u & 0x80000000u) : f;
}

static inline float bf(uint16_t h) { return from_bits((uint32_t)h << 16); }

/* The bf16 weights of one group: w[j] = bf16(d * (q_j - zero) + m) (Q4) or bf16(d * q_j). */
static void expand_group(const uint8_t *qs, float d, float m, int fmt, uint16_t w[GROUP]) {
    if (fmt == Q8_0) {
        for (int j = 0; j < GROUP; j++) w[j] = to_bf16(d * (float)(int8_t)qs[j]);
        return;
    }
    int zero = fmt == Q4_0 ? 8 : 0;
    for (int j = 0; j < 16; j++) {
        w[j] = to_bf16(d * (float)((qs[j] & 0x0F) - zero) + m);
        w[j + 16] = to_bf16(d * (float)((qs[j] >> 4) - zero) + m);
    }
}

/* lane i += x[2i+1] w[2i+1], then += x[2i] w[2i]: vdpbf16ps's order, each step an fma
 * (Intel's pseudocode; the product of two bf16 is exact in fp32 unless it leaves fp32's
 * normal range, so this is also a multiply and an add) with denormal results flushed */
static inline void dot_group(float acc[16], const uint16_t *x, const uint16_t *w) {
    for (int i = 0; i < 16; i++) {
        float a = flush(fmaf(bf(x[2 * i + 1]), bf(w[2 * i + 1]), acc[i]));
        acc[i] = flush(fmaf(bf(x[2 * i]), bf(w[2 * i]), a));
    }
}

static inline float fold16(const float a[16]) { /* the vector fold's order */
    float s8[8], s4[4];
    for (int i = 0; i < 8; i++) s8[i] = a[i] + a[i + 8];
    for (int i = 0; i < 4; i++) s4[i] = s8[i] + s8[i + 4];
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

/* Returns -1 where a column's scratch cannot be allocated, else 0. */
static int portable(const uint16_t *xb, int64_t m_rows, int64_t k, const uint8_t *qs,
                    const float *d, const float *mn, int fmt, int64_t n, float *y,
                    int threads) {
    int64_t ng = k / GROUP, width = fmt == Q8_0 ? GROUP : 16;
    int failed = 0;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t c = 0; c < n; c++) {
        uint16_t *w = malloc((size_t)k * sizeof(uint16_t));
        if (!w) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        for (int64_t g = 0; g < ng; g++)
            expand_group(qs + (c * ng + g) * width, d[c * ng + g], mn ? mn[c * ng + g] : 0.0f,
                         fmt, w + g * GROUP);
        for (int64_t r = 0; r < m_rows; r++) {
            float acc[16] = {0};
            for (int64_t g = 0; g < ng; g++) dot_group(acc, xb + r * k + g * GROUP, w + g * GROUP);
            y[r * n + c] = fold16(acc);
        }
        free(w);
    }
    return failed ? -1 : 0;
}

#ifdef QBF16_SIMD
#define INLINE static inline __attribute__((always_inline))

INLINE float fold16_v(__m512 v) {
    __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4)); /* s4[0]+s4[2], s4[1]+s4[3] */
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 0x55)));
}

/* one Q4 group to 32 bf16: the group's 16 possible weights computed and rounded once (the
 * scalar expansion's values), twice over in a 32-entry table, then looked up by nibble:
 * lanes 0-15 index with a whole byte (vpermw reads its low 5 bits: the low nibble, or the
 * low nibble + 16, the same weight), lanes 16-31 with the byte shifted right by 4 */
INLINE __m512i q4_group(const uint8_t *qs, float d, float m, int zero) {
    const __m512 idx = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i shift = _mm512_set_epi64(0x0004000400040004, 0x0004000400040004,
                                           0x0004000400040004, 0x0004000400040004, 0, 0, 0, 0);
    __m512 v = _mm512_add_ps(
        _mm512_mul_ps(_mm512_set1_ps(d), _mm512_sub_ps(idx, _mm512_set1_ps((float)zero))),
        _mm512_set1_ps(m));
    __m512i table = (__m512i)_mm512_cvtne2ps_pbh(v, v);
    __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    __m512i nib = _mm512_srlv_epi16(_mm512_cvtepu8_epi16(b), shift);
    return _mm512_permutexvar_epi16(nib, table);
}

INLINE __m512i q8_group(const int8_t *qs, float d) {
    __m512 dg = _mm512_set1_ps(d);
    __m512 lo = _mm512_mul_ps(dg, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                      _mm_loadu_si128((const __m128i *)qs))));
    __m512 hi = _mm512_mul_ps(dg, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                      _mm_loadu_si128((const __m128i *)(qs + 16)))));
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

/* block `at` of a weight's blocks in its format, as 32 bf16 (the one dispatch all paths use) */
INLINE __m512i group_bf16(const uint8_t *qs, const float *d, const float *mn, int fmt,
                          int64_t at) {
    if (fmt == Q8_0) return q8_group((const int8_t *)qs + at * GROUP, d[at]);
    return q4_group(qs + at * 16, d[at], mn ? mn[at] : 0.0f, fmt == Q4_0 ? 8 : 0);
}

static void expand_cols(const uint8_t *qs, const float *d, const float *mn, int fmt, int64_t ng,
                        int64_t nc, uint16_t *out) {
    for (int64_t i = 0; i < nc * ng; i++)
        _mm512_storeu_si512(out + i * GROUP, group_bf16(qs, d, mn, fmt, i));
}

/* NR rows (a constant at each call: the accumulators stay in registers) against nc <= CT
 * expanded columns w [nc, k] */
INLINE void tile_n(const uint16_t *xb, int64_t k, const int NR, const uint16_t *w, int64_t nc,
                   float *y, int64_t ldy) {
    __m512 acc[RT][CT];
    const uint16_t *wc[CT];
    for (int c = 0; c < CT; c++) wc[c] = w + (c < nc ? c : 0) * k;
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < CT; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < k; j += GROUP) {
        __m512i wv[CT];
        for (int c = 0; c < CT; c++) wv[c] = _mm512_loadu_si512(wc[c] + j);
        for (int r = 0; r < NR; r++) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + r * k + j);
            for (int c = 0; c < CT; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, (__m512bh)wv[c]);
        }
    }
    for (int r = 0; r < NR; r++)
        for (int64_t c = 0; c < nc; c++) y[r * ldy + c] = fold16_v(acc[r][c]);
}

static void tile(const uint16_t *xb, int64_t k, int64_t nr, const uint16_t *w, int64_t nc,
                 float *y, int64_t ldy) {
    switch (nr) {
    case 1: tile_n(xb, k, 1, w, nc, y, ldy); break;
    case 2: tile_n(xb, k, 2, w, nc, y, ldy); break;
    case 3: tile_n(xb, k, 3, w, nc, y, ldy); break;
    default: tile_n(xb, k, 4, w, nc, y, ldy); break;
    }
}

/* Rows in blocks of RB (prefill's thousands of rows: a block's bf16 rows stay in L2 while
 * every column passes over them, instead of all rows streaming from memory for each group of
 * CT columns); in a block, columns split among the threads, CT at a time expanded into an L1
 * buffer and multiplied with every row of the block. A (row, column)'s sum is the same
 * whatever block, tile or thread it falls in. */
#define RB 128
static void vector(const uint16_t *xb, int64_t m_rows, int64_t k, const uint8_t *qs,
                   const float *d, const float *mn, int fmt, int64_t n, float *y, int threads) {
    int64_t ng = k / GROUP, bytes = ng * (fmt == Q8_0 ? GROUP : 16);
#pragma omp parallel num_threads(threads)
    {
        uint16_t buf[CT * k] __attribute__((aligned(64)));
        for (int64_t b0 = 0; b0 < m_rows; b0 += RB) {
            int64_t b1 = m_rows - b0 < RB ? m_rows : b0 + RB;
#pragma omp for schedule(static)
            for (int64_t c = 0; c < n; c += CT) {
                int64_t nc = n - c < CT ? n - c : CT;
                expand_cols(qs + c * bytes, d + c * ng, mn ? mn + c * ng : NULL, fmt, ng, nc, buf);
                for (int64_t r0 = b0; r0 < b1; r0 += RT) {
                    int64_t nr = b1 - r0 < RT ? b1 - r0 : RT;
                    tile(xb + r0 * k, k, nr, buf, nc, y + r0 * n + c, n);
                }
            }
        }
    }
}

#include "qbf16_panel.h" /* prompt rows against panels of columns: lanes here, tiles below */
#endif

#ifdef QBF16_AMX
/* Rows on tiles read their weights as panels (qbf16_panel.h): tdpbf16ps takes its second
 * operand in that layout, 16 pairs a tile. */
#define AR 32  /* rows of a register block: 2 x 2 accumulator tiles */
#define AB 256 /* rows of a block: its panels made once for them (when not made for all rows) */

/* AR rows of xb (zero rows past the end) against a panel: tiles 0-3 hold the sums */
INLINE void amx_block(const uint16_t *xb, int64_t k, const uint32_t *p) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t s = 0; s < k / GROUP; s++) {
        _tile_loadd(4, xb + GROUP * s, k * 2);
        _tile_loadd(5, xb + 16 * k + GROUP * s, k * 2);
        _tile_loadd(6, p + 16 * s * AP, AP * 4);
        _tile_loadd(7, p + 16 * s * AP + 16, AP * 4);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Rows in blocks of AB; in a block, panels split among the threads, each multiplied with
 * every AR rows of the block. xb holds whole AR-row blocks (zero rows at the end), 64-byte
 * aligned (a tile row then is one cache line, not two). With `all` (room for every panel of
 * the weight) the panels are made once, before the first block, instead of once per block
 * (10x at 2,400 rows): 10-20% of a prompt's products here. Returns -1 where a thread's panel
 * cannot be allocated, else 0. */
static int amx_matmul(const uint16_t *xb, int64_t m_rows, int64_t k, const uint8_t *qs,
                      const float *d, const float *mn, int fmt, int64_t n, float *y,
                      uint32_t *all, int threads) {
    int64_t ng = k / GROUP, words = AP * k / 2;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        tile_config cfg = {.palette = 1};
        for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
        _tile_loadconfig(&cfg);
        uint32_t *own = all ? NULL : aligned_alloc(64, (size_t)words * sizeof(uint32_t));
        float out[AR * AP] __attribute__((aligned(64)));
        if (!all && !own) {
#pragma omp atomic write
            failed = 1;
        }
        if (all) {
#pragma omp for schedule(static)
            for (int64_t c = 0; c < n; c += AP)
                panel_at(qs, d, mn, fmt, ng, n, c, all + c / AP * words, 0);
        } /* (the loop's barrier: every panel made before any thread reads one) */
#pragma omp barrier
        for (int64_t b0 = 0; !failed && b0 < m_rows; b0 += AB) {
            int64_t b1 = m_rows - b0 < AB ? m_rows : b0 + AB;
#pragma omp for schedule(static)
            for (int64_t c = 0; c < n; c += AP) {
                int64_t nc = n - c < AP ? n - c : AP;
                uint32_t *p = all ? all + c / AP * words : own;
                if (!all) panel_at(qs, d, mn, fmt, ng, n, c, p, 0);
                __asm__ volatile("" ::: "memory"); /* the panel's stores before the tile loads */
                for (int64_t r0 = b0; r0 < b1; r0 += AR) {
                    int64_t nr = b1 - r0 < AR ? b1 - r0 : AR;
                    amx_block(xb + r0 * k, k, p);
                    int whole = nr == AR && nc == AP;
                    float *dst = whole ? y + r0 * n + c : out;
                    int64_t ld = whole ? n : AP;
                    _tile_stored(0, dst, ld * 4);
                    _tile_stored(1, dst + 16, ld * 4);
                    _tile_stored(2, dst + 16 * ld, ld * 4);
                    _tile_stored(3, dst + 16 * ld + 16, ld * 4);
                    for (int64_t r = 0; !whole && r < nr; r++)
                        memcpy(y + (r0 + r) * n + c, out + r * AP, (size_t)nc * sizeof(float));
                }
            }
        }
        _tile_release();
        free(own);
    }
    return failed ? -1 : 0;
}

/* Few rows (decode's batches): the panel above is built for AR rows, so 1-16 rows pay for
 * its transpose as 256 would. Here the operands swap roles: the first is 16 columns' groups
 * as the lanes expand them (one column a tile row: no transpose), the second the rows' bf16
 * pairs, transposed once per call (64 k bytes). C[column][row] is the same sum of the same
 * pairs in the same instruction sequence, so every row's bits equal amx_matmul's (tested at
 * every count around FEW). Measured at 16 rows: 2.4-3.3x the lanes; at 1, 0.7-0.8x. */
#define FC 32  /* columns a block: two tiles of 16 */

/* xb [m_rows, k] -> xt [2][k/2][16] 32-bit pairs, zero past m_rows */
static void pairs_t(const uint16_t *xb, int64_t m_rows, int64_t k, uint32_t *xt) {
    int64_t kp = k / 2;
    memset(xt, 0, (size_t)(2 * 16 * kp) * sizeof(uint32_t));
    for (int64_t r = 0; r < m_rows; r++) {
        uint32_t *dst = xt + r / 16 * 16 * kp + r % 16;
        for (int64_t p = 0; p < kp; p++) memcpy(dst + p * 16, xb + r * k + 2 * p, 4);
    }
}

/* group s of nc <= FC columns into b [FC][32] (zero columns past nc) */
INLINE void few_group(const uint8_t *qs, const float *d, const float *mn, int fmt, int64_t ng,
                      int64_t nc, int64_t s, uint16_t *b) {
    for (int64_t i = 0; i < FC; i++)
        _mm512_store_si512(b + i * GROUP, i >= nc ? _mm512_setzero_si512()
                                                  : group_bf16(qs, d, mn, fmt, i * ng + s));
}

/* nc <= FC columns against every row: each group expanded one step ahead of its tiles */
static void few_block(const uint32_t *xt, int64_t m_rows, int64_t k, const uint8_t *qs,
                      const float *d, const float *mn, int fmt, int64_t nc, float *y, int64_t n) {
    int64_t ng = k / GROUP, kp = k / 2;
    int two = m_rows > 16;
    uint16_t w[2][FC * GROUP] __attribute__((aligned(64)));
    float out[FC * FEW] __attribute__((aligned(64)));
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    few_group(qs, d, mn, fmt, ng, nc, 0, w[0]);
    for (int64_t s = 0; s < ng; s++) {
        if (s + 1 < ng) few_group(qs, d, mn, fmt, ng, nc, s + 1, w[(s + 1) & 1]);
        __asm__ volatile("" ::: "memory"); /* the groups' stores before the tile loads */
        _tile_loadd(4, w[s & 1], GROUP * 2);
        _tile_loadd(5, w[s & 1] + 16 * GROUP, GROUP * 2);
        _tile_loadd(6, xt + 16 * 16 * s, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 5, 6);
        if (two) {
            _tile_loadd(7, xt + 16 * kp + 16 * 16 * s, 64);
            _tile_dpbf16ps(2, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, out, FEW * 4);
    _tile_stored(1, out + 16 * FEW, FEW * 4);
    if (two) {
        _tile_stored(2, out + 16, FEW * 4);
        _tile_stored(3, out + 16 * FEW + 16, FEW * 4);
    }
    for (int64_t r = 0; r < m_rows; r++)
        for (int64_t i = 0; i < nc; i++) y[r * n + i] = out[i * FEW + r];
}

/* m_rows <= FEW; returns -1 where the rows' pairs cannot be allocated, else 0 */
static int amx_few(const uint16_t *xb, int64_t m_rows, int64_t k, const uint8_t *qs,
                   const float *d, const float *mn, int fmt, int64_t n, float *y, int threads) {
    int64_t ng = k / GROUP, bytes = ng * (fmt == Q8_0 ? GROUP : 16);
    uint32_t *xt = aligned_alloc(64, (size_t)(2 * 16 * (k / 2)) * sizeof(uint32_t));
    if (!xt) return -1;
    pairs_t(xb, m_rows, k, xt);
#pragma omp parallel num_threads(threads)
    {
        tile_config cfg = {.palette = 1};
        for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
        if (m_rows <= 16) /* one tile of rows: C and the rows' tile only as wide as they are */
            cfg.colsb[0] = cfg.colsb[1] = cfg.colsb[2] = cfg.colsb[3] = cfg.colsb[6] = 4 * m_rows;
        _tile_loadconfig(&cfg);
#pragma omp for schedule(static)
        for (int64_t c = 0; c < n; c += FC)
            few_block(xt, m_rows, k, qs + c * bytes, d + c * ng, mn ? mn + c * ng : NULL, fmt,
                      n - c < FC ? n - c : FC, y + c, n);
        _tile_release();
    }
    free(xt);
    return 0;
}
#endif

/* Scratch kept by each calling thread between calls (the rows' bf16 copy, the weight's
 * panels): a prompt's products reuse them instead of faulting in megabytes of fresh pages a
 * call. At most KEEP bytes each are kept, and freed when the thread ends (request threads
 * come and go); a larger need gets memory of its own, freed after the call. */
#define KEEP (16 << 20)
typedef struct {
    void *at[2];
    size_t bytes[2];
} kept_t;
static pthread_key_t kept_key;
static pthread_once_t kept_once = PTHREAD_ONCE_INIT;
static int kept_ok;

static void kept_free(void *p) {
    kept_t *k = p;
    free(k->at[0]);
    free(k->at[1]);
    free(k);
}

static void kept_init(void) { kept_ok = pthread_key_create(&kept_key, kept_free) == 0; }

/* 64-byte aligned room for `bytes` (*fresh set: the caller frees it), or NULL */
static void *scratch(int which, size_t bytes, int *fresh) {
    bytes = (bytes + 63) / 64 * 64;
    pthread_once(&kept_once, kept_init);
    kept_t *k = kept_ok ? pthread_getspecific(kept_key) : NULL;
    if (kept_ok && !k && bytes <= KEEP && (k = calloc(1, sizeof *k)) != NULL &&
        pthread_setspecific(kept_key, k) != 0) {
        free(k);
        k = NULL;
    }
    *fresh = bytes > KEEP || !k;
    if (*fresh) return aligned_alloc(64, bytes);
    if (bytes > k->bytes[which]) {
        free(k->at[which]);
        k->at[which] = aligned_alloc(64, bytes);
        k->bytes[which] = k->at[which] ? bytes : 0;
    }
    return k->at[which];
}

/* x [M, K] fp32 -> bf16 [M, K] (K a multiple of 32) */
static void round_rows(const float *x, int64_t count, uint16_t *xb, int simd) {
    int64_t i = 0;
#ifdef QBF16_SIMD
    if (simd)
        for (; i + 16 <= count; i += 16)
            _mm256_storeu_si256((__m256i *)(xb + i),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
#endif
    (void)simd;
    for (; i < count; i++) xb[i] = to_bf16(x[i]);
}

#ifdef QBF16_SIMD
typedef int (*panels_fn)(const uint16_t *xb, int64_t m_rows, int64_t k, const uint8_t *qs,
                         const float *d, const float *mn, int fmt, int64_t n, float *y,
                         uint32_t *all, int threads);

/* fn with its panels made once for every block where the rows span several blocks of
 * `block` and the kept scratch holds them all (SmolLM2-135M's layer weights; not its LM head,
 * nor a larger model's biggest weights: those per block) */
static int on_panels(panels_fn fn, int64_t block, const uint16_t *xb, int64_t m_rows, int64_t k,
                     const uint8_t *qs, const float *d, const float *mn, int fmt, int64_t n,
                     float *y, int threads) {
    int fresh = 0;
    size_t bytes = (size_t)((n + AP - 1) / AP * AP * k / 2) * sizeof(uint32_t);
    uint32_t *all = m_rows > block && bytes <= KEEP ? scratch(1, bytes, &fresh) : NULL;
    int failed = fn(xb, m_rows, k, qs, d, mn, fmt, n, y, all, threads);
    if (fresh) free(all);
    return failed;
}
#endif

/* y = xb W^T on the fastest path this CPU has (xb: disagg_qbf16_matmul's bf16 rows) */
static int multiply(const uint16_t *xb, int64_t m_rows, int64_t k, const uint8_t *qs,
                    const float *d, const float *mn, int fmt, int64_t n, float *y, int threads,
                    int simd, int amx, int lanes) {
#ifdef QBF16_AMX
    if (amx && m_rows <= FEW) return amx_few(xb, m_rows, k, qs, d, mn, fmt, n, y, threads);
    if (amx) return on_panels(amx_matmul, AB, xb, m_rows, k, qs, d, mn, fmt, n, y, threads);
#endif
#ifdef QBF16_SIMD
    if (simd && lanes && m_rows >= LANES_ROWS)
        return on_panels(lanes_matmul, LB, xb, m_rows, k, qs, d, mn, fmt, n, y, threads);
    if (simd) {
        vector(xb, m_rows, k, qs, d, mn, fmt, n, y, threads);
        return 0;
    }
#endif
    (void)simd, (void)amx, (void)lanes;
    return portable(xb, m_rows, k, qs, d, mn, fmt, n, y, threads);
}

#define PORTABLE_ONLY 1 /* the portable path even where the vector one runs (the tests') */
#define TILES 2         /* AMX where the CPU has it (see the top) */
#define DOT_LANES 4     /* prompt rows on `vector`'s accumulators, not panels (an A/B's) */

/* x [M, K] fp32; W: qs [N, K/32, 16] uint8 (fmt 0 Q4_0, 1 Q4_1) or [N, K/32, 32] int8
 * (fmt 2 Q8_0), d and mn [N, K/32] fp32 (mn NULL: none); y [M, N] fp32; `flags` the bits
 * above. Returns -1 where a scratch cannot be allocated, -2 for a shape it cannot take (k
 * not a multiple of 32), else 0. */
int disagg_qbf16_matmul(const float *x, int64_t m_rows, int64_t k, const uint8_t *qs,
                        const float *d, const float *mn, int fmt, int64_t n, float *y,
                        int threads, int flags) {
    if (k < GROUP || k % GROUP) return -2; /* (quant.qlinear's weights cannot have these) */
    if (m_rows < 1) return 0;
    int simd = disagg_qbf16_simd() && !(flags & PORTABLE_ONLY);
    int amx = simd && (flags & TILES) && disagg_qbf16_amx();
    /* the panel path reads whole blocks of 32 rows; amx_few pairs only the rows it has */
    int64_t held = amx && m_rows > FEW ? (m_rows + 31) / 32 * 32 : m_rows;
    int fresh = 0;
    uint16_t *xb = scratch(0, (size_t)(held * k) * sizeof(uint16_t), &fresh);
    if (!xb) return -1;
#pragma omp parallel for schedule(static) num_threads(threads) if (m_rows * k >= (1 << 16))
    for (int64_t r = 0; r < m_rows; r++) round_rows(x + r * k, k, xb + r * k, simd);
    memset(xb + m_rows * k, 0, (size_t)((held - m_rows) * k) * sizeof(uint16_t));
    int failed = multiply(xb, m_rows, k, qs, d, mn, fmt, n, y, threads, simd, amx,
                          !(flags & DOT_LANES));
    if (fresh) free(xb);
    return failed;
}
