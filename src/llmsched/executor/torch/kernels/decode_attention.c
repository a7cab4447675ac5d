/* Paged decode attention over bfloat16 KV caches (CPU), the two halves that
 * attention.py otherwise runs as embedding_bag calls.
 *
 * Layouts (see kv_cache.py): a layer's K plane is [kv_heads, num_blocks,
 * head_dim, block_size] (each block transposed), its V plane [kv_heads,
 * num_blocks, block_size, head_dim]. Queries are [requests, kv_heads *
 * group, head_dim], the heads sharing a KV head adjacent.
 *
 * Bits: every sum runs in float32 over the same terms in the same order as
 * PyTorch's embedding_bag (the K rows of a block by head_dim index, the V
 * rows by position), each product of two bfloat16 values is exact in
 * float32, and results are rounded to bfloat16 half away from zero as
 * embedding_bag's bfloat16 output is. So both paths give the same bits, and
 * the thread count never changes them (each output is summed by one thread).
 * Only the rows of a request's context are read; scores past it are -inf.
 */
#include "bf16.h"

#define BF16_NEG_INF 0xff80
#define MAX_GROUP 16
#define MAX_HEAD_DIM 256

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_AVX512 1

/* 16 floats rounded as f32_to_bf16 rounds them, each result in its lane's high half. */
INLINE __m512i round_high(__m512 x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i r = _mm512_add_epi32(u, _mm512_set1_epi32(0x8000));
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                           _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x400000));
    return _mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u));
}

/* Scores of up to three queries over one 128-position K block [d, 128],
 * row by row (one sequential stream), all 128 x 3 accumulators held in
 * registers. 32 bfloat16 a load: even positions become floats by a
 * shift, odd ones by a mask, and each position keeps its own accumulator,
 * so every sum is the generic loop's. */
INLINE void scores_block128(const float (*w)[MAX_HEAD_DIM], int queries, const uint16_t *kb, const int d,
                            int64_t visible, uint16_t *out, int64_t W) {
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    const __m512 z = _mm512_setzero_ps();
    __m512 a00 = z, a01 = z, a02 = z, a03 = z, a04 = z, a05 = z, a06 = z, a07 = z;
    __m512 a10 = z, a11 = z, a12 = z, a13 = z, a14 = z, a15 = z, a16 = z, a17 = z;
    __m512 a20 = z, a21 = z, a22 = z, a23 = z, a24 = z, a25 = z, a26 = z, a27 = z;
    const uint16_t *row = kb;
    for (int j = 0; j < d; j++, row += 128) {
        __m512i v0 = _mm512_loadu_si512(row), v1 = _mm512_loadu_si512(row + 32);
        __m512i v2 = _mm512_loadu_si512(row + 64), v3 = _mm512_loadu_si512(row + 96);
        __m512 x0 = _mm512_castsi512_ps(_mm512_slli_epi32(v0, 16));
        __m512 x1 = _mm512_castsi512_ps(_mm512_and_si512(v0, high));
        __m512 x2 = _mm512_castsi512_ps(_mm512_slli_epi32(v1, 16));
        __m512 x3 = _mm512_castsi512_ps(_mm512_and_si512(v1, high));
        __m512 x4 = _mm512_castsi512_ps(_mm512_slli_epi32(v2, 16));
        __m512 x5 = _mm512_castsi512_ps(_mm512_and_si512(v2, high));
        __m512 x6 = _mm512_castsi512_ps(_mm512_slli_epi32(v3, 16));
        __m512 x7 = _mm512_castsi512_ps(_mm512_and_si512(v3, high));
#define FMA8(G)                                                                                         \
    {                                                                                                   \
        __m512 wj = _mm512_set1_ps(w[G][j]);                                                            \
        a##G##0 = _mm512_fmadd_ps(wj, x0, a##G##0), a##G##1 = _mm512_fmadd_ps(wj, x1, a##G##1);         \
        a##G##2 = _mm512_fmadd_ps(wj, x2, a##G##2), a##G##3 = _mm512_fmadd_ps(wj, x3, a##G##3);         \
        a##G##4 = _mm512_fmadd_ps(wj, x4, a##G##4), a##G##5 = _mm512_fmadd_ps(wj, x5, a##G##5);         \
        a##G##6 = _mm512_fmadd_ps(wj, x6, a##G##6), a##G##7 = _mm512_fmadd_ps(wj, x7, a##G##7);         \
    }
        FMA8(0)
        if (queries > 1) FMA8(1)
        if (queries > 2) FMA8(2)
#undef FMA8
    }
    const __m512i neg_inf = _mm512_set1_epi16((short)BF16_NEG_INF);
    __mmask32 keep[4];
    for (int c = 0; c < 4; c++) {
        int64_t left = visible - 32 * c;
        keep[c] = left >= 32 ? 0xffffffffu : left <= 0 ? 0 : (__mmask32)((1ull << left) - 1);
    }
    /* Even positions' results to the low halves, odd ones' to the high: 32 bfloat16 in order. */
#define PACK(G, E, O, C)                                                                                \
    _mm512_storeu_si512(out + G * W + 32 * C,                                                           \
                        _mm512_mask_mov_epi16(neg_inf, keep[C],                                         \
                                              _mm512_or_si512(_mm512_srli_epi32(round_high(a##G##E), 16), \
                                                              round_high(a##G##O))));
#define STORE8(G) PACK(G, 0, 1, 0) PACK(G, 2, 3, 1) PACK(G, 4, 5, 2) PACK(G, 6, 7, 3)
    STORE8(0)
    if (queries > 1) { STORE8(1) }
    if (queries > 2) { STORE8(2) }
#undef STORE8
#undef PACK
}
#endif

/* Scores of one (request, KV head): [group, nb * bs] starting at out, rows W apart. */
INLINE void scores_one(const uint16_t *q, float scale, const uint16_t *keys, int64_t num_blocks,
                       const int64_t *blocks, int64_t len, int nb, int head, const int group, const int d,
                       const int bs, uint16_t *out, int64_t W) {
    float w[MAX_GROUP][MAX_HEAD_DIM];
    for (int g = 0; g < group; g++)
        for (int j = 0; j < d; j++) w[g][j] = bf16_to_f32(f32_to_bf16_away(bf16_to_f32(q[g * d + j]) * scale));
    for (int b = 0; b < nb; b++) {
        int64_t visible = len - (int64_t)b * bs;
        if (visible <= 0) {
            for (int g = 0; g < group; g++)
                for (int t = 0; t < bs; t++) out[g * W + b * bs + t] = BF16_NEG_INF;
            continue;
        }
        const uint16_t *kb = keys + (head * num_blocks + blocks[b]) * (int64_t)d * bs;
#ifdef HAVE_AVX512
        if (bs == 128) {
            for (int g = 0; g < group; g += 3)
                scores_block128(w + g, group - g < 3 ? group - g : 3, kb, d, visible, out + g * W + b * bs, W);
            continue;
        }
#endif
        for (int g = 0; g < group; g++) {
            float acc[bs];
            for (int t = 0; t < bs; t++) acc[t] = 0.f;
            for (int j = 0; j < d; j++) {
                float wj = w[g][j];
                for (int t = 0; t < bs; t++) acc[t] += wj * bf16_to_f32(kb[j * bs + t]);
            }
            uint16_t *o = out + g * W + b * bs;
            for (int t = 0; t < bs; t++) o[t] = t < visible ? f32_to_bf16_away(acc[t]) : BF16_NEG_INF;
        }
    }
}

/* Output of one (request, KV head): [group, d] at o, from probabilities rows W apart. */
INLINE void output_one(const uint16_t *p, const uint16_t *values, int64_t num_blocks, const int64_t *blocks,
                       int64_t len, int head, const int group, const int d, const int bs, uint16_t *o, int64_t W) {
    float acc[MAX_GROUP][MAX_HEAD_DIM];
    for (int g = 0; g < group; g++)
        for (int j = 0; j < d; j++) acc[g][j] = 0.f;
    for (int64_t b = 0; b * bs < len; b++) {
        const uint16_t *vb = values + (head * num_blocks + blocks[b]) * (int64_t)bs * d;
        int rows = len - b * bs < bs ? (int)(len - b * bs) : bs;
        for (int t = 0; t < rows; t++) {
            const uint16_t *row = vb + t * d;
            for (int g = 0; g < group; g++) {
                float pt = bf16_to_f32(p[g * W + b * bs + t]);
                for (int j = 0; j < d; j++) acc[g][j] += pt * bf16_to_f32(row[j]);
            }
        }
    }
    for (int g = 0; g < group; g++)
        for (int j = 0; j < d; j++) o[g * d + j] = f32_to_bf16_away(acc[g][j]);
}

/* The common (head_dim, block_size) pairs get loops of constant length,
 * which the compiler vectorizes; the output's group too, so its
 * accumulators stay in registers. */
#define SPECIALIZED(BODY, ...) \
    if (d == 64 && bs == 16) { BODY(64, 16, __VA_ARGS__); } \
    else if (d == 128 && bs == 16) { BODY(128, 16, __VA_ARGS__); } \
    else if (d == 64 && bs == 32) { BODY(64, 32, __VA_ARGS__); } \
    else if (d == 128 && bs == 32) { BODY(128, 32, __VA_ARGS__); } \
    else if (d == 64 && bs == 128) { BODY(64, 128, __VA_ARGS__); } \
    else if (d == 128 && bs == 128) { BODY(128, 128, __VA_ARGS__); } \
    else { BODY(d, bs, __VA_ARGS__); }
#define BY_GROUP(D, BS, BODY) \
    switch (group) { \
    case 1: BODY(D, BS, 1); break; \
    case 2: BODY(D, BS, 2); break; \
    case 3: BODY(D, BS, 3); break; \
    case 4: BODY(D, BS, 4); break; \
    default: BODY(D, BS, group); \
    }

int llmsched_decode_limits(int *max_group, int *max_head_dim) {
    *max_group = MAX_GROUP;
    *max_head_dim = MAX_HEAD_DIM;
    return 0;
}

void llmsched_decode_scores(const uint16_t *q, int64_t q_stride, float scale, const uint16_t *keys,
                            int64_t num_blocks, const int64_t *table, const int64_t *lens, int n, int nb,
                            int kv_heads, int group, int d, int bs, uint16_t *scores, int threads) {
    const int64_t W = (int64_t)nb * bs;
#define SCORES(D, BS, G)                                                                                   \
    _Pragma("omp parallel for num_threads(threads) schedule(dynamic, 1)")                                  \
    for (int rh = 0; rh < n * kv_heads; rh++) {                                                         \
        int r = rh / kv_heads, h = rh % kv_heads;                                                      \
        scores_one(q + r * q_stride + h * group * (D), scale, keys, num_blocks, table + (int64_t)r * nb, \
                   lens[r], nb, h, group, D, BS, scores + (int64_t)rh * group * W, W);                  \
    }
    SPECIALIZED(SCORES, group)
}

void llmsched_decode_output(const uint16_t *probs, const uint16_t *values, int64_t num_blocks,
                            const int64_t *table, const int64_t *lens, int n, int nb, int kv_heads, int group,
                            int d, int bs, uint16_t *out, int threads) {
    const int64_t W = (int64_t)nb * bs;
#define OUTPUT(D, BS, G)                                                                                    \
    _Pragma("omp parallel for num_threads(threads) schedule(dynamic, 1)")                                   \
    for (int rh = 0; rh < n * kv_heads; rh++) {                                                          \
        int r = rh / kv_heads, h = rh % kv_heads;                                                       \
        output_one(probs + (int64_t)rh * group * W, values, num_blocks, table + (int64_t)r * nb, lens[r], \
                   h, G, D, BS, out + (int64_t)rh * group * (D), W);                                 \
    }
    SPECIALIZED(BY_GROUP, OUTPUT)
}

/* The step's new K and V rows into the cache: token i's row of each KV head
 * goes to (blocks[i], offsets[i]), K transposed. k and v are [tokens,
 * kv_heads, d], their token and head strides in elements, rows contiguous. */
void llmsched_write_kv(const uint16_t *k, int64_t k_token_stride, int64_t k_head_stride, const uint16_t *v,
                       int64_t v_token_stride, int64_t v_head_stride, uint16_t *keys, uint16_t *values,
                       int64_t num_blocks, const int64_t *blocks, const int64_t *offsets, int n, int kv_heads,
                       int d, int bs, int threads) {
    _Pragma("omp parallel for num_threads(threads) schedule(static) if (n * kv_heads > 256)")
    for (int ih = 0; ih < n * kv_heads; ih++) {
        int i = ih / kv_heads, h = ih % kv_heads;
        int64_t block = (h * num_blocks + blocks[i]) * (int64_t)d * bs;
        const uint16_t *ks = k + i * k_token_stride + h * k_head_stride;
        uint16_t *kd = keys + block + offsets[i];
        for (int j = 0; j < d; j++) kd[(int64_t)j * bs] = ks[j];
        memcpy(values + block + offsets[i] * d, v + i * v_token_stride + h * v_head_stride, (size_t)d * 2);
    }
}
