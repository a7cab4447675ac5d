/* SwiGLU over float32 rows in one pass: out = silu(gate) * up for the fused
 * [tokens, 2 * intermediate] projection (layers.py runs F.silu and a
 * multiply otherwise, two passes and a buffer between). With PyTorch's
 * bits: its vectorised silu computes x / (1 + exp(-x)) with SLEEF's
 * 1-ulp float exp (Cody-Waite reduction by ln 2 in two parts, a degree-6
 * polynomial with FMAs, scaling by 2^q in two halves), which exp_like_torch
 * follows step for step; the product with up then rounds once, as the
 * in-place multiply does. kernels/swiglu.py checks the bits against this
 * PyTorch when it loads the kernel. Rows are split over threads, each
 * computed by one.
 */
#include <stdint.h>

int llmsched_swiglu_f32_supported(void) {
#if defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline __m256 exp_like_torch(__m256 d) {
    /* q = round(d / ln 2); s = d - q ln 2, with ln 2 split into a short head and a tail. */
    __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(d, _mm256_set1_ps(1.44269504088896340736f)));
    __m256 qf = _mm256_cvtepi32_ps(q);
    __m256 s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-0.693145751953125f), d);
    s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-1.428606765330187045e-06f), s);
    __m256 u = _mm256_set1_ps(0.000198527617612853646278381f);
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00139304355252534151077271f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00833336077630519866943359f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.0416664853692054748535156f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.166666671633720397949219f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.5f));
    u = _mm256_add_ps(_mm256_set1_ps(1.0f), _mm256_fmadd_ps(_mm256_mul_ps(s, s), u, s));
    /* u * 2^q as u * 2^(q >> 1) * 2^(q - (q >> 1)): each factor stays a normal float. */
    __m256i h = _mm256_srai_epi32(q, 1);
    __m256 lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(h, _mm256_set1_epi32(127)), 23));
    __m256i rest = _mm256_add_epi32(_mm256_sub_epi32(q, h), _mm256_set1_epi32(127));
    u = _mm256_mul_ps(_mm256_mul_ps(u, lo), _mm256_castsi256_ps(_mm256_slli_epi32(rest, 23)));
    /* Far below the range: 0; far above: infinity. */
    u = _mm256_andnot_ps(_mm256_cmp_ps(d, _mm256_set1_ps(-104.0f), _CMP_LT_OQ), u);
    __m256 over = _mm256_cmp_ps(_mm256_set1_ps(100.0f), d, _CMP_LT_OQ);
    return _mm256_blendv_ps(u, _mm256_set1_ps(__builtin_inff()), over);
}

static void swiglu_row(const float *gate, const float *up, float *out, int n) {
    const __m256 one = _mm256_set1_ps(1.0f);
    for (int i = 0; i < n; i += 8) {
        __m256 x = _mm256_loadu_ps(gate + i);
        __m256 e = exp_like_torch(_mm256_sub_ps(_mm256_setzero_ps(), x));
        __m256 silu = _mm256_div_ps(x, _mm256_add_ps(one, e));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
    }
}
#endif

/* out[r, :half] = silu(gu[r, :half]) * gu[r, half:2 * half]; half a multiple of 16 (PyTorch's vector
 * loop covers such rows whole, with no scalar tail). Strides in elements. */
void llmsched_swiglu_f32(const float *gu, int64_t gu_row, int rows, int half, float *out, int64_t out_row,
                         int threads) {
#if defined(__AVX2__) && defined(__FMA__)
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && (int64_t)rows * half > 65536)
    for (int r = 0; r < rows; r++) swiglu_row(gu + r * gu_row, gu + r * gu_row + half, out + r * out_row, half);
#endif
}
