/* Prompt rows' attention on AVX-512: scores against blocks of keys, values weighed 16 lanes
 * wide; included by qmatmul.c after its attention helpers (AG, and hsum8's fold order).
 *
 * Why: scores() gives each (row, position) an 8-lane accumulator of q_j k_j (lane l takes
 * j = l, l + 8, ... in order) and folds it with hsum8: 6 operations a score beside its 8
 * fmas, 8 loads against 6 fmas (as compiled: each fma read its q from memory), 6 chains of
 * dependent fmas in flight; half of a long prompt's attention. A prompt's rows all read the
 * same keys, so here each kv head's keys are laid out once a call in blocks of KB positions,
 * element j of KB positions in one register: lane l's chain runs for KB positions at once
 * (q_j broadcast against the block's element j), 24 chains in flight, and the fold adds
 * whole registers in hsum8's order. Every score is the same sequence of operations as in
 * scores(), so prompt rows keep decode rows' bits (tests/unit/test_prompt_attention.py holds
 * them to decode steps bit for bit). */
#define KB 16 /* positions a key block holds: one zmm */
#define KH 3  /* query heads scored together: KH x 8 accumulators (of 32 zmm) */
/* From this many rows a call lays the keys out: it lays out all start + M positions of every
 * kv head, which after 1,500 cached positions cost 1.7x one row's attention alone and broke
 * even between 4 and 8 rows (1.13x faster at 8, 1.35x at 16) */
#define KB_ROWS 8

/* block b of kt [blocks][d][KB]: positions b KB .. b KB + KB - 1 of k (positions d apart),
 * element-major (element j of the KB positions together), zeros from position t on */
static void key_block(const float *k, int64_t t, int64_t d, int64_t b, float *kt) {
    float *o = kt + b * d * KB;
    for (int64_t s = 0; s < KB; s++) {
        int64_t i = b * KB + s;
        for (int64_t j = 0; j < d; j++) o[j * KB + s] = i < t ? k[i * d + j] : 0.0f;
    }
}

/* p[g * ld + i] = dot(q_g, k_i) * scale for NG (<= KH) heads and positions i < t, from the
 * key blocks kt: lane l of position i's dot is its chain of fmas over j = l, l + 8, ... */
static inline __attribute__((always_inline)) void block_scores(const float *q, int64_t d,
                                                               const int NG, const float *kt,
                                                               int64_t t, float scale, float *p,
                                                               int64_t ld) {
    const __m512 sc = _mm512_set1_ps(scale);
    for (int64_t i = 0; i < t; i += KB) {
        const float *kb = kt + i * d; /* block i / KB */
        __m512 acc[KH][8];
        for (int g = 0; g < NG; g++)
            for (int l = 0; l < 8; l++) acc[g][l] = _mm512_setzero_ps();
        for (int64_t j = 0; j < d; j += 8)
            for (int l = 0; l < 8; l++) {
                __m512 kv = _mm512_loadu_ps(kb + (j + l) * KB);
                __asm__("" : "+v"(kv)); /* in a register: gcc folded a load into each fma */
                for (int g = 0; g < NG; g++)
                    acc[g][l] = _mm512_fmadd_ps(_mm512_set1_ps(q[g * d + j + l]), kv, acc[g][l]);
            }
        __mmask16 keep = t - i >= KB ? (__mmask16)0xFFFF : (__mmask16)((1u << (t - i)) - 1);
        for (int g = 0; g < NG; g++) {
            /* hsum8's order: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)) */
            const __m512 *a = acc[g];
            __m512 even = _mm512_add_ps(_mm512_add_ps(a[0], a[4]), _mm512_add_ps(a[2], a[6]));
            __m512 odd = _mm512_add_ps(_mm512_add_ps(a[1], a[5]), _mm512_add_ps(a[3], a[7]));
            __m512 score = _mm512_mul_ps(_mm512_add_ps(even, odd), sc);
            _mm512_mask_storeu_ps(p + g * ld + i, keep, score);
        }
    }
}

/* NG (<= AG) heads' scores from the key blocks, KH heads at a time */
static inline __attribute__((always_inline)) void blocks_scores(const float *q, int64_t d,
                                                                const int NG, const float *kt,
                                                                int64_t t, float scale, float *p,
                                                                int64_t ld) {
    if (NG <= KH) {
        block_scores(q, d, NG, kt, t, scale, p, ld);
    } else { /* (4: two and two) */
        block_scores(q, d, NG / 2, kt, t, scale, p, ld);
        block_scores(q + NG / 2 * d, d, NG - NG / 2, kt, t, scale, p + NG / 2 * ld, ld);
    }
}

/* weigh() 16 lanes wide: the same multiply, then add, for every output element, position by
 * position (a lane's arithmetic is its own), 64 elements of a value row in 4 registers. G
 * (<= 2 KH) heads' weights p (rows ld apart): heads g < NG0 out to o0 + g d, the rest (a
 * second row's, weighed beside the first's: attend_pair) to o1 + (g - NG0) d. */
static inline __attribute__((always_inline)) void weigh16(const float *p, int64_t ld,
                                                          const int G, const int NG0, int64_t t,
                                                          const float *v, int64_t d, float *o0,
                                                          float *o1) {
    int64_t j = 0;
    for (; j + 64 <= d; j += 64) {
        __m512 acc[2 * KH][4];
        for (int g = 0; g < G; g++)
            for (int u = 0; u < 4; u++) acc[g][u] = _mm512_setzero_ps();
        for (int64_t i = 0; i < t; i++) {
            const float *vi = v + i * d + j;
            __m512 vv[4];
            for (int u = 0; u < 4; u++) vv[u] = _mm512_loadu_ps(vi + 16 * u);
            for (int g = 0; g < G; g++) {
                __m512 w = _mm512_set1_ps(p[g * ld + i]);
                for (int u = 0; u < 4; u++)
                    acc[g][u] = _mm512_add_ps(acc[g][u], _mm512_mul_ps(w, vv[u]));
            }
        }
        for (int g = 0; g < G; g++) {
            float *o = g < NG0 ? o0 + g * d : o1 + (g - NG0) * d;
            for (int u = 0; u < 4; u++) _mm512_storeu_ps(o + j + 16 * u, acc[g][u]);
        }
    }
    if (j < d) weigh(p, ld, NG0, t, v, d, o0, j); /* (the rest, 8 lanes wide: o0's heads) */
}

/* Two prompt rows at once: rows at positions t0 - 1 and t0 (t0 and t0 + 1 positions to
 * attend over) with NG (<= KH) heads of one kv head, their 2 NG score rows in p (row 0's
 * heads, then row 1's, ld apart). Each row gets attend_n's operations in attend_n's order;
 * what the pair shares is the reading: the value rows are loaded once for both, and the
 * softmax sums of 2 NG heads advance together (their dependent adds were a tenth of the
 * kernel). d a multiple of 64. */
static inline __attribute__((always_inline)) void attend_pair_n(
    const float *q0, const float *q1, const int NG, const float *kt, const float *v, int64_t t0,
    int64_t d, float scale, float *p, int64_t ld, float *out0, float *out1) {
    const int G = 2 * NG;
    blocks_scores(q0, d, NG, kt, t0, scale, p, ld);
    blocks_scores(q1, d, NG, kt, t0 + 1, scale, p + NG * ld, ld);
    softmax_rows(p, ld, G, NG, t0, 1);
    weigh16(p, ld, G, NG, t0, v, d, out0, out1); /* both rows' heads over t0 positions */
    const float *vl = v + t0 * d; /* then row 1's last position: the last add of its sums */
    for (int g = NG; g < G; g++) {
        __m512 w = _mm512_set1_ps(p[g * ld + t0]);
        float *o = out1 + (g - NG) * d;
        for (int64_t j = 0; j < d; j += 16)
            _mm512_storeu_ps(o + j, _mm512_add_ps(_mm512_loadu_ps(o + j),
                                                  _mm512_mul_ps(w, _mm512_loadu_ps(vl + j))));
    }
}

static void attend_pair(const float *q0, const float *q1, int64_t ng, const float *kt,
                        const float *v, int64_t t0, int64_t d, float scale, float *p, int64_t ld,
                        float *out0, float *out1) {
    switch (ng) {
    case 1: attend_pair_n(q0, q1, 1, kt, v, t0, d, scale, p, ld, out0, out1); break;
    case 2: attend_pair_n(q0, q1, 2, kt, v, t0, d, scale, p, ld, out0, out1); break;
    default: attend_pair_n(q0, q1, 3, kt, v, t0, d, scale, p, ld, out0, out1); break;
    }
}
