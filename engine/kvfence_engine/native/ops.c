/* kvfence's small per-step operators for x86 CPUs with AVX2 and FMA, float32 throughout: each is
 * one call where aten's take several (a one-row decode step of SmolLM2 runs 61 RMSNorms and 30
 * attentions; in aten these were ~6 ms of its ~20, most of it dispatch and the page gather).
 *
 *   kvf_rms_norm: y = x / sqrt(mean(x^2) + eps) * w, per row.
 *   kvf_rope: q and k heads rotated by their token's cos/sin row, as aten computes
 *      x * cos + rotate_half(x) * sin (two products and a sum, each rounded: the same bits).
 *   kvf_silu_mul: silu(gate) * up from the fused gate/up linear's output (SwiGLU).
 *   kvf_decode_attention: one decode step's attention over the paged pool: each row's query
 *      heads against the keys and values at positions 0..pos of its page table (within a
 *      window: the last `window` of them), softmax(q.k * scale) in float32, read in place from
 *      the pages, nothing gathered. Grouped-query: query head h reads key head h / (H / Hkv).
 *      The pages were read-checked (core/isolation) before the step, as for aten's path.
 *
 * Built and loaded by kvfence_engine/native/__init__.py; checked against aten (F.rms_norm,
 * scaled_dot_product_attention over the gathered pages) by tests/unit/engine/test_native_ops.py. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#define AI static inline __attribute__((always_inline))
#define MAX_HEAD_DIM 256 /* kvf_decode_attention's widest head (Gemma 2 and 3: 256) */

int kvf_ops_abi(void) { return 3; }

AI float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

AI int min(int a, int b) { return a < b ? a : b; }

/* e^x for x <= 88 (x below about -87.3 gives 0): x = n ln2 + r, |r| <= ln2 / 2, e^r by its
 * degree-6 Taylor polynomial (relative error below 2e-7 there: about float32's rounding), times
 * 2^n put into the exponent. */
AI __m256 exp_neg(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    /* r = x - n ln2, ln2 in two parts so that n * ln2_hi is exact */
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                             _mm256_set1_epi32(127)), 23);
    const __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
    return _mm256_andnot_ps(under, e);
}

/* x: [T, heads, D] at x[t * x_stride + h * D + d] (D a multiple of 16); cos, sin: [T, D];
 * y: [T, heads, D] */
void kvf_rope(const float *x, ptrdiff_t x_stride, const float *cos, const float *sin, float *y,
              int T, int heads, int D) {
    const int half = D / 2;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int t = 0; t < T; t++) {
        const float *c = cos + (ptrdiff_t)t * D, *s = sin + (ptrdiff_t)t * D;
        for (int h = 0; h < heads; h++) {
            const float *xh = x + t * x_stride + (ptrdiff_t)h * D;
            float *yh = y + ((ptrdiff_t)t * heads + h) * D;
            for (int d = 0; d < half; d += 8) {
                const __m256 lo = _mm256_loadu_ps(xh + d), hi = _mm256_loadu_ps(xh + half + d);
                const __m256 ylo = _mm256_add_ps(
                    _mm256_mul_ps(lo, _mm256_loadu_ps(c + d)),
                    _mm256_mul_ps(_mm256_xor_ps(hi, sign), _mm256_loadu_ps(s + d)));
                const __m256 yhi =
                    _mm256_add_ps(_mm256_mul_ps(hi, _mm256_loadu_ps(c + half + d)),
                                  _mm256_mul_ps(lo, _mm256_loadu_ps(s + half + d)));
                _mm256_storeu_ps(yh + d, ylo);
                _mm256_storeu_ps(yh + half + d, yhi);
            }
        }
    }
}

/* gate_up: [rows, 2 * inter], each row's gate then up (inter a multiple of 8); out: [rows,
 * inter] = gate / (1 + e^-gate) * up */
void kvf_silu_mul(const float *gate_up, float *out, int rows, int inter) {
    const __m256 one = _mm256_set1_ps(1.0f), top = _mm256_set1_ps(88.0f);
    const __m256 inf = _mm256_set1_ps(INFINITY), sign = _mm256_set1_ps(-0.0f);
#pragma omp parallel for schedule(static) if (rows * inter >= 32768)
    for (int r = 0; r < rows; r++) {
        const float *g = gate_up + (ptrdiff_t)r * 2 * inter, *u = g + inter;
        float *o = out + (ptrdiff_t)r * inter;
        for (int i = 0; i < inter; i += 8) {
            const __m256 x = _mm256_loadu_ps(g + i), neg = _mm256_xor_ps(x, sign);
            /* e^-x; past 88 it is infinite and silu is -0 (aten's: -x / e^-x, below 1e-36) */
            const __m256 e = _mm256_blendv_ps(exp_neg(_mm256_min_ps(neg, top)), inf,
                                              _mm256_cmp_ps(neg, top, _CMP_GT_OQ));
            const __m256 silu = _mm256_div_ps(x, _mm256_add_ps(one, e));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
        }
    }
}

/* x, y: [rows, dim] (dim a multiple of 8); w: [dim] */
void kvf_rms_norm(const float *x, const float *w, float *y, int rows, int dim, float eps) {
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (ptrdiff_t)r * dim;
        float *yr = y + (ptrdiff_t)r * dim;
        __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
        int i = 0;
        for (; i + 16 <= dim; i += 16) {
            const __m256 a = _mm256_loadu_ps(xr + i), b = _mm256_loadu_ps(xr + i + 8);
            s0 = _mm256_fmadd_ps(a, a, s0);
            s1 = _mm256_fmadd_ps(b, b, s1);
        }
        for (; i < dim; i += 8) {
            const __m256 a = _mm256_loadu_ps(xr + i);
            s0 = _mm256_fmadd_ps(a, a, s0);
        }
        const float inv = 1.0f / sqrtf(hsum(_mm256_add_ps(s0, s1)) / (float)dim + eps);
        const __m256 vi = _mm256_set1_ps(inv);
        for (i = 0; i < dim; i += 8)
            _mm256_storeu_ps(yr + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), vi),
                                                   _mm256_loadu_ps(w + i)));
    }
}

/* One query head of one row: q [D] against the keys at positions first..last of `table`
 * (page_size slots a page; a slot's key head kvh at kc[((page * page_size + slot) * Hkv + kvh)
 * * D]); out [D]. scores: room for last - first + 1 floats. */
AI void attend_head(const float *q, const float *kc, const float *vc, const int64_t *table,
                    int first, int last, int page_size, int Hkv, int kvh, int D, float scale,
                    float *scores, float *out) {
    const int n = last - first + 1;
    const ptrdiff_t step = (ptrdiff_t)Hkv * D; /* from one slot's head kvh to the next slot's */
    float top = -INFINITY;
    for (int p = first, i = 0; p <= last;) { /* a page at a time: one division a page */
        const int off = p % page_size, count = min(page_size - off, last - p + 1);
        const float *k = kc + ((ptrdiff_t)table[p / page_size] * page_size + off) * step + kvh * D;
        for (int j = 0; j < count; j++, i++, k += step) {
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
            int d = 0;
            for (; d + 16 <= D; d += 16) {
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), _mm256_loadu_ps(k + d + 8), a1);
            }
            for (; d < D; d += 8)
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), a0);
            const float s = hsum(_mm256_add_ps(a0, a1)) * scale;
            scores[i] = s;
            top = s > top ? s : top;
        }
        p += count;
    }
    const __m256 vtop = _mm256_set1_ps(top);
    __m256 vsum = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(scores + i), vtop));
        _mm256_storeu_ps(scores + i, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    float sum = hsum(vsum);
    if (i < n) { /* the tail, through a padded vector */
        float tail[8];
        for (int j = 0; j < 8; j++) tail[j] = i + j < n ? scores[i + j] - top : -INFINITY;
        _mm256_storeu_ps(tail, exp_neg(_mm256_loadu_ps(tail)));
        for (int j = 0; i + j < n; j++) {
            scores[i + j] = tail[j];
            sum += tail[j];
        }
    }
    __m256 acc[MAX_HEAD_DIM / 8];
    for (int c = 0; c < D / 8; c++) acc[c] = _mm256_setzero_ps();
    for (int p = first, i = 0; p <= last;) {
        const int off = p % page_size, count = min(page_size - off, last - p + 1);
        const float *v = vc + ((ptrdiff_t)table[p / page_size] * page_size + off) * step + kvh * D;
        for (int j = 0; j < count; j++, i++, v += step) {
            const __m256 e = _mm256_set1_ps(scores[i]);
            for (int c = 0; c < D / 8; c++)
                acc[c] = _mm256_fmadd_ps(e, _mm256_loadu_ps(v + 8 * c), acc[c]);
        }
        p += count;
    }
    const __m256 inv = _mm256_set1_ps(1.0f / sum);
    for (int c = 0; c < D / 8; c++) _mm256_storeu_ps(out + 8 * c, _mm256_mul_ps(acc[c], inv));
}

/* q: row b's head h at q[b * q_stride + h * D]; kc, vc: one layer's pool [pages, page_size,
 * Hkv, D]; table: [B, width] pages; pos: [B] each row's position (it attends to 0..pos, or with
 * window > 0 to the last `window` positions up to pos); out: [B, H, D]. D a multiple of 8, at
 * most MAX_HEAD_DIM.
 * Returns 0; -2 where a position lies outside its table or a page the table reads outside the
 * pool's `pages` (nothing is read); -1 where the scores' memory could not be had. */
int kvf_decode_attention(const float *q, ptrdiff_t q_stride, const float *kc, const float *vc,
                         int64_t pages, const int64_t *table, int width, const int64_t *pos,
                         int B, int H, int Hkv, int D, int page_size, int window, float scale,
                         float *out) {
    const int group = H / Hkv;
    ptrdiff_t longest = 1;
    for (int b = 0; b < B; b++) {
        if (pos[b] < 0 || pos[b] >= (int64_t)width * page_size) return -2;
        for (int64_t i = 0; i <= pos[b] / page_size; i++) {
            const int64_t page = table[(ptrdiff_t)b * width + i];
            if (page < 0 || page >= pages) return -2;
        }
        longest = pos[b] + 1 > longest ? pos[b] + 1 : longest;
    }
    float *scores = malloc(sizeof(float) * (size_t)longest * (size_t)omp_get_max_threads());
    if (!scores) return -1;
#pragma omp parallel for schedule(static)
    for (int bh = 0; bh < B * H; bh++) {
        const int b = bh / H, h = bh % H;
        const int last = (int)pos[b];
        const int first = window > 0 && last + 1 > window ? last + 1 - window : 0;
        const float *qh = q + b * q_stride + (ptrdiff_t)h * D;
        const int64_t *tb = table + (ptrdiff_t)b * width;
        float *sc = scores + longest * omp_get_thread_num(), *o = out + (ptrdiff_t)bh * D;
        if (D == 64) /* the common head dims, unrolled with their sums in registers */
            attend_head(qh, kc, vc, tb, first, last, page_size, Hkv, h / group, 64, scale, sc, o);
        else if (D == 128)
            attend_head(qh, kc, vc, tb, first, last, page_size, Hkv, h / group, 128, scale, sc, o);
        else
            attend_head(qh, kc, vc, tb, first, last, page_size, Hkv, h / group, D, scale, sc, o);
    }
    free(scores);
    return 0;
}
