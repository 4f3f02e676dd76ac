/* kvfence's linears on a GGUF's own blocks, for x86 CPUs with AVX2, FMA and F16C:
 * y = x @ W.T (+ bias), x and y float32, W [N, K] in blocks of 32 along K, each as ggml lays it
 * out:
 *
 *   Q4 (block_q4_1, 20 bytes): fp16 d, fp16 m, 16 bytes of 4-bit values q (byte j holds q[j] in
 *      its low nibble and q[j + 16] in its high one); w = d * q + m (a Q4_0 block: m = -8 d).
 *   Q8 (block_q8_0, 34 bytes): fp16 d, 32 int8 values q; w = d * q.
 *
 * The products and sums are float32: the result is a float32 GEMM's on the file's weights, up to
 * the order of the additions. (aten's int4 kernel rounds scales, activations and output to
 * bfloat16; fbgemm's float16 GEMM, the other path for a Q8_0 lm_head, reads 2 bytes a weight.)
 *
 * One row (a decode step's usual batch) sums q * x per block and scales it by d once (Q4: the m
 * part is m times the row's sum over the block, precomputed). Up to 11 rows dequantize each
 * block once to float32 into registers and share it, TILE rows at a time. From 12 rows (busy
 * decode steps, prefills) each output's weights are dequantized once into a panel in L1 (NR
 * outputs at a time) and every MR x NR tile of rows and outputs sums along K from it, each x
 * vector loaded once for NR outputs; CHUNK rows of x a pass over the outputs. On SmolLM2's
 * shapes (AVX2, 2 cores) the panel runs 16 rows at 107-137 GFLOP/s where the register tiles ran
 * 91-114, 64 rows at 151-165 against 84-91 (fbgemm's float16 GEMM: ~180); below 12 rows the
 * tiles win. The outputs are split across the OpenMP threads, the same libgomp pool torch's
 * own operators use (torch loads libgomp.so.1 before this library, which names the same
 * soname).
 *
 * Built and loaded by kvfence_engine/native/__init__.py; checked against float64 on the
 * dequantized weights by tests/unit/engine/test_native_kernels.py. */
#include <immintrin.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#define AI static inline __attribute__((always_inline))
#define BLOCK 32
#define TILE 8        /* rows of a register tile (fewer than PANEL_ROWS) */
#define PANEL_ROWS 12 /* rows from which each output is dequantized once into a panel */
#define MR 4          /* rows of a micro-tile */
#define NR 3          /* outputs of a micro-tile: MR * NR sums in 12 of the 16 registers */
#define CHUNK 64      /* rows of x a pass over the outputs reads (~150-400 KB: in L2) */
#define PREFETCH 4096 /* bytes ahead in the block stream: measured, 320 to 16384 */

enum kind { Q4, Q8 };

int kvf_blocks_abi(void) { return 3; }

AI int qbytes(enum kind kind) { return kind == Q4 ? 20 : 34; }

AI float half(const uint8_t *p) {
    uint16_t h;
    __builtin_memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* a block's 32 values q as float32, in 4 vectors of 8 in order; its d and m. The block stream
 * PREFETCH bytes ahead is asked for. */
AI void fetch(enum kind kind, const uint8_t *blk, __m256 v[4], float *d, float *m) {
    _mm_prefetch((const char *)blk + PREFETCH, _MM_HINT_T0);
    *d = half(blk);
    if (kind == Q4) {
        *m = half(blk + 2);
        const __m128i raw = _mm_loadu_si128((const __m128i *)(blk + 4));
        const __m128i mask = _mm_set1_epi8(0x0F);
        const __m128i lo = _mm_and_si128(raw, mask);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
        v[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
        v[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
        v[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
        v[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
    } else {
        *m = 0.0f;
        const __m128i lo = _mm_loadu_si128((const __m128i *)(blk + 2));
        const __m128i hi = _mm_loadu_si128((const __m128i *)(blk + 18));
        v[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
        v[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
        v[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
        v[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
    }
}

/* a block's 32 weights as float32, w = d * q + m (one rounding), in 4 vectors of 8 in order */
AI void weights(enum kind kind, const uint8_t *blk, __m256 w[4]) {
    float d, m;
    fetch(kind, blk, w, &d, &m);
    const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) w[c] = _mm256_fmadd_ps(w[c], vd, vm);
}

AI float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* one output for one row: each block's sum of q * x scaled by its d once (two chains, so the
 * FMAs do not wait on one another), plus (Q4) m times the block's sum of x, xs */
AI float one_row(enum kind kind, const uint8_t *q, int nb, const float *x, const float *xs) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    float mterm = 0.0f;
    for (int blk = 0; blk < nb; blk++) {
        const uint8_t *b = q + (ptrdiff_t)blk * qbytes(kind);
        __m256 v[4];
        float d, m;
        fetch(kind, b, v, &d, &m);
        const float *xb = x + (ptrdiff_t)blk * BLOCK;
        __m256 s0 = _mm256_mul_ps(v[0], _mm256_loadu_ps(xb));
        __m256 s1 = _mm256_mul_ps(v[1], _mm256_loadu_ps(xb + 8));
        s0 = _mm256_fmadd_ps(v[2], _mm256_loadu_ps(xb + 16), s0);
        s1 = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(xb + 24), s1);
        const __m256 vd = _mm256_set1_ps(d);
        acc0 = _mm256_fmadd_ps(s0, vd, acc0);
        acc1 = _mm256_fmadd_ps(s1, vd, acc1);
        if (kind == Q4) mterm += m * xs[blk];
    }
    return hsum(_mm256_add_ps(acc0, acc1)) + mterm;
}

/* one output for a tile of R rows (R a constant once inlined): each block dequantized once to
 * float32 (w = d * q + m, one rounding) and multiplied into every row. At 2 rows or fewer each
 * row sums into several accumulators (an FMA's latency is 4 cycles). */
AI void tile_rows(enum kind kind, int R, const uint8_t *q, int nb, const float *x, ptrdiff_t K,
                  float *y, ptrdiff_t N, float b) {
    const int A = R <= 1 ? 4 : R <= 2 ? 2 : 1;
    __m256 acc[TILE][4];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int a = 0; a < A; a++) acc[r][a] = _mm256_setzero_ps();
    for (int blk = 0; blk < nb; blk++) {
        __m256 w[4];
        weights(kind, q + (ptrdiff_t)blk * qbytes(kind), w);
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

/* one output's weights, every block dequantized to float32 (w = d * q + m, one rounding), into
 * out [nb * 32] */
AI void dequantize(enum kind kind, const uint8_t *q, int nb, float *out) {
    for (int blk = 0; blk < nb; blk++) {
        __m256 w[4];
        weights(kind, q + (ptrdiff_t)blk * qbytes(kind), w);
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) _mm256_storeu_ps(out + blk * BLOCK + c * 8, w[c]);
    }
}

/* R rows of x times C dequantized outputs (R <= MR, C <= NR constants once inlined): R * C sums
 * along K, 8 products a vector, each x vector loaded once for the C outputs */
AI void micro(int R, int C, const float *x, ptrdiff_t K, const float *panel, float *y,
              ptrdiff_t N, const float *b) {
    __m256 acc[MR][NR];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 3
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    for (ptrdiff_t k = 0; k < K; k += 8) {
        __m256 w[NR];
#pragma GCC unroll 3
        for (int c = 0; c < C; c++) w[c] = _mm256_loadu_ps(panel + c * K + k);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const __m256 xv = _mm256_loadu_ps(x + r * K + k);
#pragma GCC unroll 3
            for (int c = 0; c < C; c++) acc[r][c] = _mm256_fmadd_ps(xv, w[c], acc[r][c]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 3
        for (int c = 0; c < C; c++) y[r * N + c] = hsum(acc[r][c]) + b[c];
}

#define MICRO(R, C) micro(R, C, xr, K, panel, yr, N, b)

/* q: [N, K/32] blocks of qbytes(kind); x: [M, K]; y: [M, N]; bias: [N] or NULL. K is a
 * multiple of 32. Every pointer is to contiguous memory. Returns 0, or -1 where the threads'
 * panels could not be had (y is then not written). */
AI int linear(enum kind kind, const uint8_t *q, const float *bias, const float *x, float *y,
              int M, int N, int K) {
    const int nb = K / BLOCK;
    const ptrdiff_t row_bytes = (ptrdiff_t)nb * qbytes(kind);
    if (M == 1) {
        float xs[nb];
        for (int blk = 0; kind == Q4 && blk < nb; blk++) {
            float s = 0.0f;
            for (int i = 0; i < BLOCK; i++) s += x[blk * BLOCK + i];
            xs[blk] = s;
        }
#pragma omp parallel for schedule(static)
        for (int n = 0; n < N; n++)
            y[n] = one_row(kind, q + n * row_bytes, nb, x, xs) + (bias ? bias[n] : 0.0f);
        return 0;
    }
    if (M < PANEL_ROWS) {
#pragma omp parallel for schedule(static)
        for (int n = 0; n < N; n++) {
            const uint8_t *qn = q + n * row_bytes;
            const float b = bias ? bias[n] : 0.0f;
            for (int r0 = 0; r0 < M; r0 += TILE) {
                const float *xt = x + (ptrdiff_t)r0 * K;
                float *yt = y + (ptrdiff_t)r0 * N + n;
                switch (M - r0 < TILE ? M - r0 : TILE) {
                case 8: tile_rows(kind, 8, qn, nb, xt, K, yt, N, b); break;
                case 7: tile_rows(kind, 7, qn, nb, xt, K, yt, N, b); break;
                case 6: tile_rows(kind, 6, qn, nb, xt, K, yt, N, b); break;
                case 5: tile_rows(kind, 5, qn, nb, xt, K, yt, N, b); break;
                case 4: tile_rows(kind, 4, qn, nb, xt, K, yt, N, b); break;
                case 3: tile_rows(kind, 3, qn, nb, xt, K, yt, N, b); break;
                case 2: tile_rows(kind, 2, qn, nb, xt, K, yt, N, b); break;
                default: tile_rows(kind, 1, qn, nb, xt, K, yt, N, b); break;
                }
            }
        }
        return 0;
    }
    /* each thread's panel: NR outputs dequantized, shared by every MR-row tile of a CHUNK */
    float *panels = malloc(sizeof(float) * NR * (size_t)K * (size_t)omp_get_max_threads());
    if (!panels) return -1;
#pragma omp parallel
    {
        float *panel = panels + (ptrdiff_t)NR * K * omp_get_thread_num();
        for (int c0 = 0; c0 < M; c0 += CHUNK) {
            const int end = M - c0 < CHUNK ? M : c0 + CHUNK;
#pragma omp for schedule(static) nowait
            for (int n0 = 0; n0 < N; n0 += NR) {
                const int C = N - n0 < NR ? N - n0 : NR;
                float b[NR] = {0.0f, 0.0f, 0.0f};
                for (int c = 0; c < C; c++) {
                    dequantize(kind, q + (n0 + c) * row_bytes, nb, panel + (ptrdiff_t)c * K);
                    b[c] = bias ? bias[n0 + c] : 0.0f;
                }
                for (int r0 = c0; r0 < end; r0 += MR) {
                    const float *xr = x + (ptrdiff_t)r0 * K;
                    float *yr = y + (ptrdiff_t)r0 * N + n0;
                    const int R = end - r0 < MR ? end - r0 : MR;
                    if (C == NR) {
                        switch (R) {
                        case 4: MICRO(4, 3); break;
                        case 3: MICRO(3, 3); break;
                        case 2: MICRO(2, 3); break;
                        default: MICRO(1, 3); break;
                        }
                    } else {
                        for (int c = 0; c < C; c++) {
                            const float *pc = panel + (ptrdiff_t)c * K;
                            for (int r = 0; r < R; r++)
                                micro(1, 1, xr + (ptrdiff_t)r * K, K, pc, yr + (ptrdiff_t)r * N + c,
                                      N, b + c);
                        }
                    }
                }
            }
        }
    }
    free(panels);
    return 0;
}

int kvf_q4_linear(const uint8_t *q, const float *bias, const float *x, float *y, int M, int N,
                  int K) {
    return linear(Q4, q, bias, x, y, M, N, K);
}

int kvf_q8_linear(const uint8_t *q, const float *bias, const float *x, float *y, int M, int N,
                  int K) {
    return linear(Q8, q, bias, x, y, M, N, K);
}
