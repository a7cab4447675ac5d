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
#include <stdint.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))
#define BF16_NEG_INF 0xff80
#define MAX_GROUP 16
#define MAX_HEAD_DIM 256

INLINE float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

INLINE uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    return (uint16_t)((u + 0x8000u) >> 16);
}

/* Scores of one (request, KV head): [group, nb * bs] starting at out, rows W apart. */
INLINE void scores_one(const uint16_t *q, float scale, const uint16_t *keys, int64_t num_blocks,
                       const int64_t *blocks, int64_t len, int nb, int head, int group, const int d,
                       const int bs, uint16_t *out, int64_t W) {
    float w[MAX_GROUP][MAX_HEAD_DIM];
    for (int g = 0; g < group; g++)
        for (int j = 0; j < d; j++) w[g][j] = bf16_to_f32(f32_to_bf16(bf16_to_f32(q[g * d + j]) * scale));
    for (int b = 0; b < nb; b++) {
        int64_t visible = len - (int64_t)b * bs;
        if (visible <= 0) {
            for (int g = 0; g < group; g++)
                for (int t = 0; t < bs; t++) out[g * W + b * bs + t] = BF16_NEG_INF;
            continue;
        }
        const uint16_t *kb = keys + (head * num_blocks + blocks[b]) * (int64_t)d * bs;
        for (int g = 0; g < group; g++) {
            float acc[bs];
            for (int t = 0; t < bs; t++) acc[t] = 0.f;
            for (int j = 0; j < d; j++) {
                float wj = w[g][j];
                for (int t = 0; t < bs; t++) acc[t] += wj * bf16_to_f32(kb[j * bs + t]);
            }
            uint16_t *o = out + g * W + b * bs;
            for (int t = 0; t < bs; t++) o[t] = t < visible ? f32_to_bf16(acc[t]) : BF16_NEG_INF;
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
        for (int j = 0; j < d; j++) o[g * d + j] = f32_to_bf16(acc[g][j]);
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
 * kv_heads, d], strides in elements ([0] token, [1] head), rows contiguous. */
void llmsched_write_kv(const uint16_t *k, const int64_t *k_strides, const uint16_t *v, const int64_t *v_strides,
                       uint16_t *keys, uint16_t *values, int64_t num_blocks, const int64_t *blocks,
                       const int64_t *offsets, int n, int kv_heads, int d, int bs, int threads) {
    _Pragma("omp parallel for num_threads(threads) schedule(static) if (n * kv_heads > 256)")
    for (int ih = 0; ih < n * kv_heads; ih++) {
        int i = ih / kv_heads, h = ih % kv_heads;
        int64_t block = (h * num_blocks + blocks[i]) * (int64_t)d * bs;
        const uint16_t *ks = k + i * k_strides[0] + h * k_strides[1];
        uint16_t *kd = keys + block + offsets[i];
        for (int j = 0; j < d; j++) kd[(int64_t)j * bs] = ks[j];
        memcpy(values + block + offsets[i] * d, v + i * v_strides[0] + h * v_strides[1], (size_t)d * 2);
    }
}
