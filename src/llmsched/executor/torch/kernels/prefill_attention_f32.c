/* Causal prefill attention over float32 rows, for CPUs with AVX2 and FMA
 * (attention.py runs PyTorch's SDPA elsewhere).
 *
 * Query i of lq sits at position off + i (off = lk - lq: the context before
 * the chunk) and sees keys 0..off + i. The query heads that share a KV head
 * are taken together as one list of rows, (token, head) token-major, and
 * work is split into (KV head, tile of ROWS such rows). A tile takes the
 * keys KB at a time with an online softmax: scores of the scaled queries
 * from a 6 x 16 register-blocked product, exp in float32, float32 accumulators, one
 * division by the row sum at the end. Blocks past the tile's last row are
 * never computed, so a causal prefill does about half the work of a square
 * one. The arithmetic is the flash kernel's kind but not its order (nor its
 * exp): outputs differ from PyTorch's by float32 rounding.
 *
 * A row's sums run in the same order whichever tile it falls in (keys from
 * 0 in KB blocks; keys past the row's own get probability 0, which adds
 * nothing), and each tile is computed by one thread: a query gets the same
 * bits however its chunk is cut (chunked prefill, prefix-cache hits) or
 * threaded.
 *
 * K and V are first repacked per KV head: K as [block of 16 keys][dim][16
 * keys], V as [key][dim], both padded with zero keys to a multiple of 16.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ROWS 24 /* rows per tile: 4 strips of 6 */
#define KB 256
#define MAX_HEAD_DIM 256

int llmsched_prefill_f32_supported(void) {
#if defined(__AVX2__) && defined(__FMA__)
    return MAX_HEAD_DIM;
#else
    return 0;
#endif
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* exp(x) in float32 to about 2 ulp for -87 <= x <= 0 (callers mask what lies outside). */
static inline __m256 exp_neg(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    /* 2^n from the exponent bits: n >= -126 after the clamp, so it is normal. */
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float hmax(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static void pack_keys(const float *k, int64_t k_tok, int lk, int d, float *kp, int nblk) {
    for (int b = 0; b < nblk; b++) {
        float *dst = kp + (int64_t)b * d * 16;
        for (int n = 0; n < 16; n++) {
            int key = b * 16 + n;
            const float *src = key < lk ? k + key * k_tok : NULL;
            for (int c = 0; c < d; c++) dst[c * 16 + n] = src ? src[c] : 0.0f;
        }
    }
}

static void pack_values(const float *v, int64_t v_tok, int lk, int d, float *vp, int nkeys) {
    for (int key = 0; key < nkeys; key++) {
        if (key < lk)
            memcpy(vp + (int64_t)key * d, v + key * v_tok, sizeof(float) * d);
        else
            memset(vp + (int64_t)key * d, 0, sizeof(float) * d);
    }
}

/* s[r][16b .. 16b+16) = q[r] . keys of group b, for 6 rows of q (stride MAX_HEAD_DIM), nb groups. */
static void scores6(const float *q, int d, const float *kp, int nb, float *s) {
    for (int b = 0; b < nb; b++) {
        __m256 acc[6][2];
        for (int r = 0; r < 6; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        const float *kk = kp + (int64_t)b * d * 16;
        for (int c = 0; c < d; c++) {
            __m256 k0 = _mm256_loadu_ps(kk + c * 16), k1 = _mm256_loadu_ps(kk + c * 16 + 8);
            for (int r = 0; r < 6; r++) {
                __m256 qb = _mm256_broadcast_ss(q + r * MAX_HEAD_DIM + c);
                acc[r][0] = _mm256_fmadd_ps(qb, k0, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(qb, k1, acc[r][1]);
            }
        }
        for (int r = 0; r < 6; r++) {
            _mm256_storeu_ps(s + r * KB + b * 16, acc[r][0]);
            _mm256_storeu_ps(s + r * KB + b * 16 + 8, acc[r][1]);
        }
    }
}

/* o[r][c .. c+16) += sum over nk keys j of p[r][j] * vp[j][c .. c+16), for 6 rows. */
static void pv6(const float *p, int nk, const float *vp, int d, int c, float *o) {
    __m256 acc[6][2];
    for (int r = 0; r < 6; r++) {
        acc[r][0] = _mm256_loadu_ps(o + r * MAX_HEAD_DIM + c);
        acc[r][1] = _mm256_loadu_ps(o + r * MAX_HEAD_DIM + c + 8);
    }
    for (int j = 0; j < nk; j++) {
        const float *row = vp + (int64_t)j * d + c;
        __m256 v0 = _mm256_loadu_ps(row), v1 = _mm256_loadu_ps(row + 8);
        for (int r = 0; r < 6; r++) {
            __m256 pb = _mm256_broadcast_ss(p + r * KB + j);
            acc[r][0] = _mm256_fmadd_ps(pb, v0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(pb, v1, acc[r][1]);
        }
    }
    for (int r = 0; r < 6; r++) {
        _mm256_storeu_ps(o + r * MAX_HEAD_DIM + c, acc[r][0]);
        _mm256_storeu_ps(o + r * MAX_HEAD_DIM + c + 8, acc[r][1]);
    }
}

/* Lanes c..c+7 of a row that fall among its first `seen` keys (all ones where visible). */
static inline __m256 visible(int c, int seen) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(seen - c), lane));
}

/* One row's online-softmax step over nk scores s (a multiple of 16), of
 * which the first `seen` are visible: updates the running max m and sum l,
 * leaves the probabilities in s (0 where not visible) and rescales the
 * row's output accumulators o by how far the max moved. */
static void softmax_block(float *s, int nk, int seen, float *m, float *l, float *o, int d) {
    if (seen <= 0) { /* the row sees none of this block */
        memset(s, 0, sizeof(float) * nk);
        return;
    }
    /* Whole vectors of visible keys first, then the one a row's last key falls in, masked. */
    int whole = seen & ~7;
    __m256 mx = _mm256_set1_ps(-INFINITY);
    for (int c = 0; c < whole; c += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + c));
    if (whole < seen)
        mx = _mm256_max_ps(mx, _mm256_blendv_ps(mx, _mm256_loadu_ps(s + whole), visible(whole, seen)));
    float mnew = hmax(mx);
    if (mnew < *m) mnew = *m;
    float alpha = expf(*m - mnew);
    *m = mnew;
    __m256 vm = _mm256_set1_ps(mnew), sum = _mm256_setzero_ps();
    for (int c = 0; c < whole; c += 8) {
        __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(s + c), vm));
        sum = _mm256_add_ps(sum, e);
        _mm256_storeu_ps(s + c, e);
    }
    for (int c = whole; c < nk; c += 8) {
        __m256 e = _mm256_and_ps(visible(c, seen), exp_neg(_mm256_sub_ps(_mm256_loadu_ps(s + c), vm)));
        sum = _mm256_add_ps(sum, e);
        _mm256_storeu_ps(s + c, e);
    }
    *l = *l * alpha + hsum(sum);
    if (alpha != 1.0f)
        for (int c = 0; c < d; c += 8)
            _mm256_storeu_ps(o + c, _mm256_mul_ps(_mm256_loadu_ps(o + c), _mm256_set1_ps(alpha)));
}

/* One (KV head, tile): rows r0..r0+rows-1 of the head's (token, group head) rows into out. */
static void attend_tile(const float *q, int64_t q_tok, int64_t q_head, const float *kp, const float *vp, int off,
                        int d, int group, float scale, int r0, int rows, float *out, int64_t o_tok,
                        int64_t o_head) {
    float qb[ROWS * MAX_HEAD_DIM] __attribute__((aligned(32)));
    float s[ROWS * KB] __attribute__((aligned(32)));
    float o[ROWS * MAX_HEAD_DIM] __attribute__((aligned(32)));
    float m[ROWS], l[ROWS];
    int strips = (rows + 5) / 6;
    for (int r = 0; r < strips * 6; r++) {
        m[r] = -INFINITY;
        if (r < rows) {
            l[r] = 0.0f;
            int t = (r0 + r) / group, h = (r0 + r) % group;
            const float *src = q + t * q_tok + h * q_head;
            for (int c = 0; c < d; c++) qb[r * MAX_HEAD_DIM + c] = src[c] * scale;
        } else {
            memset(qb + r * MAX_HEAD_DIM, 0, sizeof(float) * d);
        }
        memset(o + r * MAX_HEAD_DIM, 0, sizeof(float) * d);
    }
    int kend = off + (r0 + rows - 1) / group + 1; /* the keys the tile's last row sees */
    for (int k0 = 0; k0 < kend; k0 += KB) {
        int kn = kend - k0 < KB ? kend - k0 : KB, nb = (kn + 15) / 16;
        const float *kblk = kp + (int64_t)k0 * d;
        for (int b = 0; b < nb; b++)
            for (int st = 0; st < strips; st++)
                scores6(qb + st * 6 * MAX_HEAD_DIM, d, kblk + (int64_t)b * d * 16, 1, s + st * 6 * KB + b * 16);
        for (int r = 0; r < strips * 6; r++) {
            if (r >= rows) { /* padding rows: probabilities 0 */
                memset(s + r * KB, 0, sizeof(float) * nb * 16);
                continue;
            }
            int seen = off + (r0 + r) / group + 1 - k0;
            softmax_block(s + r * KB, nb * 16, seen < kn ? seen : kn, &m[r], &l[r], o + r * MAX_HEAD_DIM, d);
        }
        const float *vblk = vp + (int64_t)k0 * d;
        for (int c = 0; c < d; c += 16)
            for (int st = 0; st < strips; st++)
                pv6(s + st * 6 * KB, nb * 16, vblk, d, c, o + st * 6 * MAX_HEAD_DIM);
    }
    for (int r = 0; r < rows; r++) {
        __m256 inv = _mm256_set1_ps(1.0f / l[r]);
        int t = (r0 + r) / group, h = (r0 + r) % group;
        float *dst = out + t * o_tok + h * o_head;
        for (int c = 0; c < d; c += 8)
            _mm256_storeu_ps(dst + c, _mm256_mul_ps(_mm256_loadu_ps(o + r * MAX_HEAD_DIM + c), inv));
    }
}
#endif

/* Returns 0, or -1 when the packed K and V cannot be allocated (nothing is written then).
 * out[i, h, :] = softmax(scale * q[i, h] . k[0..off+i, h / group]) . v[...], all float32.
 * Strides are in elements; each row's head_dim values are contiguous.
 * head_dim must be a multiple of 16 and at most MAX_HEAD_DIM. */
int llmsched_prefill_attention_f32(const float *q, int64_t q_tok, int64_t q_head, const float *k, int64_t k_tok,
                                   int64_t k_head, const float *v, int64_t v_tok, int64_t v_head, float *out,
                                   int64_t o_tok, int64_t o_head, int lq, int lk, int nh, int kvh, int d,
                                   float scale, int threads) {
#if defined(__AVX2__) && defined(__FMA__)
    int nblk = (lk + 15) / 16, nkeys = nblk * 16, group = nh / kvh;
    float *kp = aligned_alloc(64, sizeof(float) * (size_t)kvh * nkeys * d);
    float *vp = aligned_alloc(64, sizeof(float) * (size_t)kvh * nkeys * d);
    if (kp == NULL || vp == NULL) {
        free(kp);
        free(vp);
        return -1;
    }
    int off = lk - lq, rows = lq * group, ntiles = (rows + ROWS - 1) / ROWS;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int g = 0; g < kvh; g++) {
            pack_keys(k + g * k_head, k_tok, lk, d, kp + (int64_t)g * nkeys * d, nblk);
            pack_values(v + g * v_head, v_tok, lk, d, vp + (int64_t)g * nkeys * d, nkeys);
        }
        /* Later tiles see more keys: hand them out first. */
#pragma omp for schedule(dynamic, 1)
        for (int t = 0; t < kvh * ntiles; t++) {
            int tile = ntiles - 1 - t / kvh, g = t % kvh;
            int r0 = tile * ROWS, n = rows - r0 < ROWS ? rows - r0 : ROWS;
            attend_tile(q + (int64_t)g * group * q_head, q_tok, q_head, kp + (int64_t)g * nkeys * d,
                        vp + (int64_t)g * nkeys * d, off, d, group, scale, r0, n, out + (int64_t)g * group * o_head,
                        o_tok, o_head);
        }
    }
    free(kp);
    free(vp);
#endif
    return 0;
}
