/* Panels of a weight's columns, and prompt rows multiplied against them on AVX512-BF16
 * lanes; included by qbf16.c inside its SIMD section (it uses INLINE, GROUP, group_bf16).
 *
 * A panel: AP columns, p [k/2][AP] holding each column's pair j (its bf16 weights j, j+1) as
 * one 32-bit word, 16 columns' pair j in one load: in pair order, the layout tdpbf16ps reads
 * its second operand in (qbf16.c's rows on tiles), or lane-major (pair 16 g + i at row
 * i k/32 + g: the lanes below read lane i's pairs of every group in a row).
 *
 * Why prompt rows take panels on the lanes: `vector` (qbf16.c) gives each (row, column) a
 * 16-lane accumulator of its own (lane i takes pair i of every group of 32, in group order),
 * then folds the lanes with shuffles: about 8 operations an output, a fifth of a 576-wide
 * product's work, the gap between it and a dense GEMM on the same instruction. Here a
 * register holds one lane of 16 columns: the row's pair i of group g, broadcast, against the
 * 16 columns' pair 16 g + i. Lane i of every column runs the instruction sequence it runs in
 * `vector` (the instruction's arithmetic is lane for lane; the pair's two products are the
 * same, whichever operand holds the weight), kept apart for each i, and the fold adds whole
 * registers in fold16_v's order: ~1 add an output, and the same bits as `vector`, so a
 * prompt row still gets a decode row's bits (tests/unit/test_qbf16_kernels.py holds both to
 * the portable reference). */
#define AP 32
#define LR 12  /* rows of a lane tile: 12 x 2 accumulators, 2 weights, 1 broadcast (of 32 zmm) */
#define LB 256 /* rows of a block: a block's rows stay in L2 while the panels pass over them */
#define LX 28000 /* bytes of a lane tile's rows: they stay in L1 while the panel streams by */
#define LANES_ROWS 64 /* from this many rows, prompt rows take panels (qbf16.c multiply) */

INLINE void transpose16(__m512i r[16]) { /* 16 x 16 32-bit words, in registers */
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int b = 0; b < 16; b += 4) {
        u[b] = _mm512_unpacklo_epi64(t[b], t[b + 2]);
        u[b + 1] = _mm512_unpackhi_epi64(t[b], t[b + 2]);
        u[b + 2] = _mm512_unpacklo_epi64(t[b + 1], t[b + 3]);
        u[b + 3] = _mm512_unpackhi_epi64(t[b + 1], t[b + 3]);
    }
    for (int e = 0; e < 4; e++) { /* u[4b + e], 128-bit lane L: rows 4b..4b+3, column 4L + e */
        __m512i v0 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x44);
        __m512i v1 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xEE);
        __m512i v2 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0x44);
        __m512i v3 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0xEE);
        r[e] = _mm512_shuffle_i32x4(v0, v2, 0x88);
        r[4 + e] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
        r[8 + e] = _mm512_shuffle_i32x4(v1, v3, 0x88);
        r[12 + e] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
    }
}

/* The panel of nc <= AP columns straight from their blocks: for each 16 columns, group g's
 * 16 pairs of each column (one expanded group) transposed into 16 rows of the panel. */
static void make_panel(const uint8_t *qs, const float *d, const float *mn, int fmt, int64_t ng,
                       int64_t nc, uint32_t *p, int lane_major) {
    for (int h = 0; h < AP; h += 16)
        for (int64_t g = 0; g < ng; g++) {
            __m512i r[16];
            for (int i = 0; i < 16; i++)
                r[i] = h + i >= nc ? _mm512_setzero_si512()
                                   : group_bf16(qs, d, mn, fmt, (h + i) * ng + g);
            transpose16(r);
            for (int j = 0; j < 16; j++)
                _mm512_store_si512(p + (lane_major ? j * ng + g : 16 * g + j) * AP + h, r[j]);
        }
}

/* the panel of the columns c..c+AP-1 (fewer at the end) of a weight of n columns into p */
static void panel_at(const uint8_t *qs, const float *d, const float *mn, int fmt, int64_t ng,
                     int64_t n, int64_t c, uint32_t *p, int lane_major) {
    int64_t bytes = ng * (fmt == Q8_0 ? GROUP : 16);
    make_panel(qs + c * bytes, d + c * ng, mn ? mn + c * ng : NULL, fmt, ng,
               n - c < AP ? n - c : AP, p, lane_major);
}

/* NR rows (a constant at each call: the accumulators stay in registers) of xb against panel p;
 * y [NR, nc] of leading dimension ldy. Lanes i and i + 8 are added as the fold's first step
 * once the second is summed (half the partial sums in memory). */
INLINE void lanes_tile_n(const uint16_t *xb, int64_t k, const int NR, const uint32_t *p,
                         float *y, int64_t ldy, int64_t nc) {
    float part[8 * LR * AP] __attribute__((aligned(64)));
    int64_t ng = k / GROUP;
    for (int i = 0; i < 16; i++) {
        __m512 acc[LR][2];
        for (int r = 0; r < NR; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        const uint32_t *pw = p + i * ng * AP; /* lane-major: lane i's pairs in group order */
        const uint16_t *xr = xb + 2 * i;
        for (int64_t g = 0; g < ng; g++, pw += AP, xr += GROUP) {
            __m512bh w0 = (__m512bh)_mm512_load_si512(pw);
            __m512bh w1 = (__m512bh)_mm512_load_si512(pw + 16);
            for (int r = 0; r < NR; r++) {
                uint32_t pair;
                memcpy(&pair, xr + r * k, sizeof pair);
                __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pair);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xv, w0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xv, w1);
            }
        }
        float *at = part + (i % 8) * LR * AP;
        for (int r = 0; r < NR; r++)
            for (int h = 0; h < 2; h++) {
                __m512 s = acc[r][h];
                if (i >= 8) s = _mm512_add_ps(_mm512_load_ps(at + r * AP + 16 * h), s);
                _mm512_store_ps(at + r * AP + 16 * h, s); /* i >= 8: s8[i - 8] */
            }
    }
    for (int r = 0; r < NR; r++)
        for (int h = 0; h < 2 && 16 * h < nc; h++) {
            __m512 s8[8], s4[4];
            for (int i = 0; i < 8; i++) s8[i] = _mm512_load_ps(part + (i * LR + r) * AP + 16 * h);
            for (int i = 0; i < 4; i++) s4[i] = _mm512_add_ps(s8[i], s8[i + 4]);
            __m512 sum = _mm512_add_ps(_mm512_add_ps(s4[0], s4[2]), _mm512_add_ps(s4[1], s4[3]));
            int64_t left = nc - 16 * h;
            __mmask16 keep = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
            _mm512_mask_storeu_ps(y + r * ldy + 16 * h, keep, sum);
        }
}

static void lanes_tile(const uint16_t *xb, int64_t k, int64_t nr, const uint32_t *p, float *y,
                       int64_t ldy, int64_t nc) {
    switch (nr) {
#define LANES_CASE(R) \
    case R: lanes_tile_n(xb, k, R, p, y, ldy, nc); break;
        LANES_CASE(1) LANES_CASE(2) LANES_CASE(3) LANES_CASE(4) LANES_CASE(5) LANES_CASE(6)
        LANES_CASE(7) LANES_CASE(8) LANES_CASE(9) LANES_CASE(10) LANES_CASE(11)
#undef LANES_CASE
    default: lanes_tile_n(xb, k, LR, p, y, ldy, nc); break;
    }
}

/* Rows in blocks of LB; in a block, panels split among the threads, each multiplied with
 * every LR rows of the block. With `all` (room for every panel of the weight) the panels are
 * made once, before the first block. Returns -1 where a thread's panel cannot be
 * allocated, else 0. */
static int lanes_matmul(const uint16_t *xb, int64_t m_rows, int64_t k, const uint8_t *qs,
                        const float *d, const float *mn, int fmt, int64_t n, float *y,
                        uint32_t *all, int threads) {
    int64_t ng = k / GROUP, words = AP * k / 2;
    int64_t lr = LX / (2 * k) < 1 ? 1 : LX / (2 * k) > LR ? LR : LX / (2 * k);
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        uint32_t *own = all ? NULL : aligned_alloc(64, (size_t)words * sizeof(uint32_t));
        if (!all && !own) {
#pragma omp atomic write
            failed = 1;
        }
        if (all) {
#pragma omp for schedule(static)
            for (int64_t c = 0; c < n; c += AP)
                panel_at(qs, d, mn, fmt, ng, n, c, all + c / AP * words, 1);
        } /* (the loop's barrier: every panel made before any thread reads one) */
#pragma omp barrier
        for (int64_t b0 = 0; !failed && b0 < m_rows; b0 += LB) {
            int64_t b1 = m_rows - b0 < LB ? m_rows : b0 + LB;
#pragma omp for schedule(static)
            for (int64_t c = 0; c < n; c += AP) {
                int64_t nc = n - c < AP ? n - c : AP;
                uint32_t *p = all ? all + c / AP * words : own;
                if (!all) panel_at(qs, d, mn, fmt, ng, n, c, p, 1);
                for (int64_t r0 = b0; r0 < b1; r0 += lr)
                    lanes_tile(xb + r0 * k, k, b1 - r0 < lr ? b1 - r0 : lr, p, y + r0 * n + c,
                               n, nc);
            }
        }
        free(own);
    }
    return failed ? -1 : 0;
}
