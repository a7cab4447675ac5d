/* RMSNorm over bfloat16 rows in one pass, alone or after the residual add
 * (layers.py runs each as a chain of PyTorch ops otherwise), with PyTorch's
 * bits: the float32 sum of squares in the order its contiguous sum adds
 * them (see sum_squares), the mean, eps and 1 / sqrt each rounded in
 * float32 as its ops round them, then the normalised row rounded to
 * bfloat16 and multiplied by the weight with a second rounding, as the
 * reference does; a residual add rounds its float32 sum. Every rounding to
 * bfloat16 is to nearest even, as PyTorch's. Rows are split over threads,
 * each computed by one, so the thread count never changes the bits.
 */
#include <math.h>

#include "bf16.h"

#define ILP 4
#define LEVELS 4
#define LEVEL_STEP 16

/* Eight lanes, in whatever vector registers the machine has. */
typedef float v8f __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));

INLINE v8f load8(const uint16_t *p) {
    v8h h;
    memcpy(&h, p, sizeof h);
    return (v8f)(__builtin_convertvector(h, v8u) << 16);
}

/* f32_to_bf16_even on eight lanes. */
INLINE v8h bf16x8(v8f f) {
    v8u u = (v8u)f;
    v8u rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    v8u nan = (v8u)((u & 0x7fffffffu) > 0x7f800000u);
    return __builtin_convertvector(nan | (rounded & ~nan), v8h);
}

INLINE v8f round8(v8f f) { return (v8f)(__builtin_convertvector(bf16x8(f), v8u) << 16); }

INLINE void store8(uint16_t *p, v8f f) {
    v8h h = bf16x8(f);
    memcpy(p, &h, sizeof h);
}

#ifdef __AVX512BW__
#include <immintrin.h>

INLINE __m512 load16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* f32_to_bf16_even on sixteen lanes, as the low halves of 32-bit lanes. */
INLINE __m512i bf16x16(__m512 f) {
    __m512i u = _mm512_castps_si512(f);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                            _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0xffff));
}

INLINE __m512 round16(__m512 f) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16x16(f), 16)); }

INLINE void store16(uint16_t *p, __m512 f) { _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(bf16x16(f))); }
#endif

/* acc += x^2 over one vector of 8 * m lanes (a square of a bfloat16 value is exact in float32). */
INLINE void add_squares(v8f *acc, const uint16_t *x, int m) {
    for (int j = 0; j < m; j++) {
        v8f v = load8(x + 8 * j);
        acc[j] += v * v;
    }
}

/* The float32 sum of a row's squares, added in the order of PyTorch's
 * contiguous sum, so that mean(x^2) has its bits. The row is read as
 * vectors of the width PyTorch's kernel uses (lanes, 8 or 16), taken in
 * groups of 4 into 4 accumulators, which a cascade folds upward every 16
 * groups (keeping partial sums of similar size); leftover vectors go into
 * the first accumulator, the 4 are folded in order, and the scalar tail is
 * summed first and the lanes added to it in order. Under one vector,
 * scalars are summed into 4 accumulators the same way. */
static float sum_squares(const uint16_t *x, int h, int lanes) {
    if (h < lanes) {
        float a[ILP] = {0};
        int i = 0;
        for (; i + ILP <= h; i += ILP)
            for (int k = 0; k < ILP; k++) a[k] += bf16_to_f32(x[i + k]) * bf16_to_f32(x[i + k]);
        for (; i < h; i++) a[0] += bf16_to_f32(x[i]) * bf16_to_f32(x[i]);
        return ((a[0] + a[1]) + a[2]) + a[3];
    }
    int m = lanes / 8, nvec = h / lanes, groups = nvec / ILP, g = 0;
    v8f acc[LEVELS][ILP][2];
    memset(acc, 0, sizeof(acc));
    while (g + LEVEL_STEP <= groups) {
        for (int j = 0; j < LEVEL_STEP; j++, g++)
            for (int k = 0; k < ILP; k++) add_squares(acc[0][k], x + (g * ILP + k) * lanes, m);
        for (int lv = 1; lv < LEVELS; lv++) {
            for (int k = 0; k < ILP; k++)
                for (int j = 0; j < m; j++) {
                    acc[lv][k][j] += acc[lv - 1][k][j];
                    acc[lv - 1][k][j] = (v8f){0};
                }
            if (g & ((LEVEL_STEP - 1) << (lv * 4))) break;
        }
    }
    for (; g < groups; g++)
        for (int k = 0; k < ILP; k++) add_squares(acc[0][k], x + (g * ILP + k) * lanes, m);
    for (int lv = 1; lv < LEVELS; lv++)
        for (int k = 0; k < ILP; k++)
            for (int j = 0; j < m; j++) acc[0][k][j] += acc[lv][k][j];
    for (int v = groups * ILP; v < nvec; v++) add_squares(acc[0][0], x + v * lanes, m);
    for (int k = 1; k < ILP; k++)
        for (int j = 0; j < m; j++) acc[0][0][j] += acc[0][k][j];
    float total = 0.0f;
    for (int i = nvec * lanes; i < h; i++) total += bf16_to_f32(x[i]) * bf16_to_f32(x[i]);
    for (int j = 0; j < m; j++)
        for (int l = 0; l < 8; l++) total += acc[0][0][j][l];
    return total;
}

/* One row: out = bf16(bf16(x * rsqrt(mean(x^2) + eps)) * w), each step rounded where PyTorch rounds it. */
INLINE void norm_row(const uint16_t *x, const uint16_t *w, int h, float eps, int lanes, uint16_t *out) {
    float r = 1.0f / sqrtf(sum_squares(x, h, lanes) / (float)h + eps);
    int i = 0;
#ifdef __AVX512BW__
    __m512 vr = _mm512_set1_ps(r);
    for (; i + 16 <= h; i += 16) store16(out + i, _mm512_mul_ps(round16(_mm512_mul_ps(load16(x + i), vr)), load16(w + i)));
#endif
    for (; i + 8 <= h; i += 8) store8(out + i, round8(load8(x + i) * r) * load8(w + i));
    for (; i < h; i++) out[i] = f32_to_bf16_even(bf16_to_f32(f32_to_bf16_even(bf16_to_f32(x[i]) * r)) * bf16_to_f32(w[i]));
}

/* RMSNorm of rows x[a, b, :h] (strides in elements, last dim contiguous) into out[a, b, :h]. */
void llmsched_rms_norm(const uint16_t *x, int64_t xa, int64_t xb, int na, int nb, int h, const uint16_t *w,
                       float eps, int lanes, uint16_t *out, int64_t oa, int64_t ob, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && (int64_t)na * nb * h > 65536)
    for (int64_t r = 0; r < (int64_t)na * nb; r++) {
        int64_t a = r / nb, b = r % nb;
        norm_row(x + a * xa + b * xb, w, h, eps, lanes, out + a * oa + b * ob);
    }
}

/* x[n, :h] += d[n, :h] (rounded to bfloat16), then out = RMSNorm(x): a residual add and the next norm. */
void llmsched_add_rms_norm(uint16_t *x, int64_t xs, const uint16_t *d, int64_t ds, int n, int h, const uint16_t *w,
                           float eps, int lanes, uint16_t *out, int64_t os, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && (int64_t)n * h > 65536)
    for (int r = 0; r < n; r++) {
        uint16_t *xr = x + r * xs;
        const uint16_t *dr = d + r * ds;
        int i = 0;
#ifdef __AVX512BW__
        for (; i + 16 <= h; i += 16) store16(xr + i, _mm512_add_ps(load16(xr + i), load16(dr + i)));
#endif
        for (; i + 8 <= h; i += 8) store8(xr + i, load8(xr + i) + load8(dr + i));
        for (; i < h; i++) xr[i] = f32_to_bf16_even(bf16_to_f32(xr[i]) + bf16_to_f32(dr[i]));
        norm_row(xr, w, h, eps, lanes, out + r * os);
    }
}

/* sums[r] = the float32 sum of squares norm_row uses for row r of x[n, :h] (tests compare it with PyTorch's). */
void llmsched_sum_squares(const uint16_t *x, int64_t xs, int n, int h, int lanes, float *sums) {
    for (int r = 0; r < n; r++) sums[r] = sum_squares(x + r * xs, h, lanes);
}
