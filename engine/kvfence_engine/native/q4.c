/* kvfence's int4 linear for x86 CPUs with AVX2, FMA and F16C: y = x @ W.T (+ bias), W in the GGUF's
 * own 4-bit blocks, x and y float32.
 *
 * W is [N, K] in blocks of 32 along K, each ggml's block_q4_1: fp16 d, fp16 m, then 16 bytes of
 * 4-bit values q (byte j holds q[j] in its low nibble and q[j + 16] in its high one); its weights
 * are w = d * q + m (a Q4_0 block: m = -8 d, exact in fp16). The products and sums are float32:
 * the result is a float32 GEMM's on the file's weights, up to the order of the additions.
 * (aten's int4 kernel, the other int4 path, rounds scales, activations and output to bfloat16.)
 * One row (a decode step's usual batch) sums q * x per block and scales it by d once; more rows
 * dequantize each block once to float32 and share it.
 *
 * The rows of x are taken up to TILE at a time, so each block is unpacked once per tile: one row
 * reads 4.5 bits a weight (a decode step's time is those bytes); TILE rows share them. The
 * outputs are split across the OpenMP threads, the same libgomp pool torch's own operators use
 * (torch loads libgomp.so.1 before this library, which names the same soname).
 *
 * Built and loaded by kvfence_engine/native/__init__.py; checked against F.linear on the
 * dequantized weights by tests/unit/engine/test_native_int4.py. */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#define BLOCK 32
#define TILE 8
#define CHUNK 64 /* rows of x a pass over the outputs reads (~150-400 KB: in L2) */
#define QBYTES 20 /* fp16 d, fp16 m, 16 bytes of nibbles: ggml's block_q4_1 */
#define PREFETCH 4096 /* bytes ahead in the block stream: measured, 320 to 16384 */

int kvf_q4_abi(void) { return 1; }

static inline float half(const uint8_t *p) {
    uint16_t h;
    __builtin_memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline __attribute__((always_inline)) void
dequant_block(const uint8_t *blk, __m256 w[4]) {
    const float d = half(blk), m = half(blk + 2);
    const __m128i v = _mm_loadu_si128((const __m128i *)(blk + 4));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(v, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
    const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
    w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), vd, vm);
    w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), vd, vm);
    w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), vd, vm);
    w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), vd, vm);
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* one output n for a tile of R rows (R a constant once inlined). Each row sums into A
 * accumulators, so that at few rows the FMAs do not wait on one another (an FMA's latency is
 * 4 cycles: one row's single chain would take 16 a block). */
static inline __attribute__((always_inline)) void
tile_rows(int R, const uint8_t *q, int nb, const float *x,
          ptrdiff_t K, float *y, ptrdiff_t N, float b) {
    const int A = R <= 1 ? 4 : R <= 2 ? 2 : 1;
    __m256 acc[TILE][4];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int a = 0; a < A; a++) acc[r][a] = _mm256_setzero_ps();
    for (int blk = 0; blk < nb; blk++) {
        __m256 w[4];
        _mm_prefetch((const char *)q + (ptrdiff_t)blk * QBYTES + PREFETCH, _MM_HINT_T0);
        dequant_block(q + (ptrdiff_t)blk * QBYTES, w);
        const float *xb = x + (ptrdiff_t)blk * BLOCK;
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
#pragma GCC unroll 8
            for (int r = 0; r < R; r++)
                acc[r][c % A] = _mm256_fmadd_ps(w[c], _mm256_loadu_ps(xb + r * K + c * 8),
                                                acc[r][c % A]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
#pragma GCC unroll 4
        for (int a = 1; a < A; a++) acc[r][0] = _mm256_add_ps(acc[r][0], acc[r][a]);
        y[r * N] = hsum(acc[r][0]) + b;
    }
}

/* one output n for one row: each block's sum of q * x is scaled by its d once (5 FMAs a block
 * where dequantizing takes 8), and the m part is m . (the row's sum over each block), the block
 * sums xs precomputed once per call. */
static inline float one_row(const uint8_t *q, int nb, const float *x, const float *xs) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    const __m128i mask = _mm_set1_epi8(0x0F);
    float mterm = 0.0f;
    for (int blk = 0; blk < nb; blk++) {
        const uint8_t *b = q + (ptrdiff_t)blk * QBYTES;
        _mm_prefetch((const char *)b + PREFETCH, _MM_HINT_T0);
        const __m128i v = _mm_loadu_si128((const __m128i *)(b + 4));
        const __m128i lo = _mm_and_si128(v, mask);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
        const float *xb = x + (ptrdiff_t)blk * BLOCK;
        __m256 s0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), _mm256_loadu_ps(xb));
        __m256 s1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))),
                                  _mm256_loadu_ps(xb + 8));
        s0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), _mm256_loadu_ps(xb + 16), s0);
        s1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))),
                             _mm256_loadu_ps(xb + 24), s1);
        const __m256 vd = _mm256_set1_ps(half(b));
        mterm += half(b + 2) * xs[blk];
        acc0 = _mm256_fmadd_ps(s0, vd, acc0);
        acc1 = _mm256_fmadd_ps(s1, vd, acc1);
    }
    return hsum(_mm256_add_ps(acc0, acc1)) + mterm;
}

/* q: [N, K/32] blocks of QBYTES; x: [M, K]; y: [M, N]; bias: [N] or NULL. K is a multiple of
 * 32. Every pointer is to contiguous memory. */
void kvf_q4_linear(const uint8_t *q, const float *bias,
                   const float *x, float *y, int M, int N, int K) {
    const int nb = K / BLOCK;
    if (M == 1) {
        float xs[nb];
        for (int blk = 0; blk < nb; blk++) {
            float s = 0.0f;
            for (int i = 0; i < BLOCK; i++) s += x[blk * BLOCK + i];
            xs[blk] = s;
        }
#pragma omp parallel for schedule(static)
        for (int n = 0; n < N; n++)
            y[n] = one_row(q + (ptrdiff_t)n * nb * QBYTES, nb, x, xs) + (bias ? bias[n] : 0.0f);
        return;
    }
    /* Rows go CHUNK at a time, so a chunk of x stays in L2 while every output sweeps it; within
     * a chunk an output's blocks stay in L1 from one tile of rows to the next. */
#pragma omp parallel
    for (int c0 = 0; c0 < M; c0 += CHUNK) {
        const int rows = M - c0 < CHUNK ? M - c0 : CHUNK;
#pragma omp for schedule(static)
        for (int n = 0; n < N; n++) {
            const uint8_t *qn = q + (ptrdiff_t)n * nb * QBYTES;
            const float b = bias ? bias[n] : 0.0f;
            for (int r0 = c0; r0 < c0 + rows; r0 += TILE) {
                const float *xt = x + (ptrdiff_t)r0 * K;
                float *yt = y + (ptrdiff_t)r0 * N + n;
                switch (c0 + rows - r0 < TILE ? c0 + rows - r0 : TILE) {
                case 8: tile_rows(8, qn, nb, xt, K, yt, N, b); break;
                case 7: tile_rows(7, qn, nb, xt, K, yt, N, b); break;
                case 6: tile_rows(6, qn, nb, xt, K, yt, N, b); break;
                case 5: tile_rows(5, qn, nb, xt, K, yt, N, b); break;
                case 4: tile_rows(4, qn, nb, xt, K, yt, N, b); break;
                case 3: tile_rows(3, qn, nb, xt, K, yt, N, b); break;
                case 2: tile_rows(2, qn, nb, xt, K, yt, N, b); break;
                default: tile_rows(1, qn, nb, xt, K, yt, N, b); break;
                }
            }
        }
    }
}
