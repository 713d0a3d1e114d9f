/* The low-bit GEMM: y (M, N) fp32 = x (M, K) fp32 @ W^T, W as 4-bit codes in blocks of 32 (see lowbit.py).
 *
 * Weights, per tile of 8 outputs and block b of 32 inputs (LB_TILE_BYTES bytes, tiles in order, blocks in order):
 *   128 bytes of codes: vector i (0..3), byte j (0..31) = output 8t + j/4, input k = 32b + 4i + j%4 in the low nibble
 *                       and k + 16 in the high nibble (codes 0..15);
 *   8 fp16 d, then 8 fp16 m (one per output): w[n][k] = d * q + m.
 * The weight's K may be a multiple of the input's (planes: block b reads input block b % (K_in / 32)), so an 8-bit
 * weight runs as two 4-bit planes over the same input without copying it.
 *
 * Activations: each row's 32-input blocks are quantised on their own to int8 (scale amax / 127, round to nearest even),
 * and each block's exact fp32 sum is kept for the m term. Per output and block, sum(q * qx) is an exact integer
 * (maddubs to int16, at most 8 * 2 * 15 * 127 = 30480, then madd to int32); the output accumulates
 *   acc = fma(float(isum), d * dx, acc); acc = fma(m, xsum, acc)
 * over the blocks in order. Every row is computed by the same instructions in the same order whatever M is and
 * whichever rows share its register block, and threads split the outputs (never K): a row's bits do not depend on
 * the row count. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define LB_TILE_BYTES 160
#define LB_VERSION 2
#ifndef LB_RS
#define LB_RS 4 /* rows per register block (up to 4 rows: two tiles of 8 outputs share each row's broadcasts) */
#endif
#ifndef LB_RW
#define LB_RW 8 /* 5..8 rows run as one register block of one tile, so a verify of 8 unpacks each weight block once
                 * instead of twice (measured on a 2-core AMD EPYC, AVX2, 2026-12-07: 30 layers at 8 rows 10.3 -> 8.8 ms;
                 * at 9 to 32 rows it did not help, so those keep blocks of 4 rows x 2 tiles) */
#endif
#ifndef LB_TS
#define LB_TS 2 /* tiles of 8 outputs per register block */
#endif

int lowbit_version(void) { return LB_VERSION; }

/* Row r's blocks: qx (K int8), dx (K/32 scales), xs (K/32 sums). */
static void quantize_row(const float *x, int k, int8_t *qx, float *dx, float *xs) {
    for (int b = 0; b < k / 32; b++) {
        const float *p = x + 32 * b;
        __m256 v[4], a = _mm256_setzero_ps(), s;
        const __m256 sign = _mm256_set1_ps(-0.0f);
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(p + 8 * i);
            a = _mm256_max_ps(a, _mm256_andnot_ps(sign, v[i]));
        }
        s = _mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3]));
        __m128 a4 = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        a4 = _mm_max_ps(a4, _mm_movehl_ps(a4, a4));
        a4 = _mm_max_ss(a4, _mm_movehdup_ps(a4));
        __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
        s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        s4 = _mm_add_ss(s4, _mm_movehdup_ps(s4));
        float amax = _mm_cvtss_f32(a4);
        xs[b] = _mm_cvtss_f32(s4);
        dx[b] = amax / 127.0f;
        const __m256 id = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        __m256i q[4];
        for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id));  /* nearest even */
        __m256i q01 = _mm256_packs_epi32(q[0], q[1]), q23 = _mm256_packs_epi32(q[2], q[3]);
        __m256i q8 = _mm256_packs_epi16(q01, q23);
        /* undo the packs' lane interleave: dwords 0 4 1 5 2 6 3 7 -> 0..7 */
        q8 = _mm256_permutevar8x32_epi32(q8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(qx + 32 * b), q8);
    }
}

/* R rows (R <= 4) against T adjacent tiles of 8 outputs (T <= 2; tile u's bytes at w + u * tstride): out[r][8u + 0..7].
 * Each row's instructions and their order are the same whatever R and T are. */
static inline __attribute__((always_inline)) void tile_rows(const uint8_t *w, size_t tstride, int nbw, int nbx, const int8_t *const *qx,
                                                             const float *const *dx, const float *const *xs, float *const *out, int ncols,
                                                             const int R, const int T) {
    const __m256i lo4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[8][2];
    for (int r = 0; r < R; r++)
        for (int u = 0; u < T; u++) acc[r][u] = _mm256_setzero_ps();
    for (int b = 0, bx = 0; b < nbw; b++, bx = bx + 1 == nbx ? 0 : bx + 1) {
        const uint8_t *wb = w + (size_t)b * LB_TILE_BYTES;
        __m256i s16[8][2];
        for (int r = 0; r < R; r++)
            for (int u = 0; u < T; u++) s16[r][u] = _mm256_setzero_si256();
#pragma GCC unroll 1
        for (int i = 0; i < 4; i++) { /* not unrolled: gcc would hoist every maddubs and spill */
            __m256i lo[2], hi[2];
            for (int u = 0; u < T; u++) {
                const __m256i p = _mm256_loadu_si256((const __m256i *)(wb + u * tstride + 32 * i));
                lo[u] = _mm256_and_si256(p, lo4);
                hi[u] = _mm256_and_si256(_mm256_srli_epi16(p, 4), lo4);
            }
            for (int r = 0; r < R; r++) {
                const int8_t *q = qx[r] + 32 * bx + 4 * i;
                int32_t a, c;
                memcpy(&a, q, 4);
                memcpy(&c, q + 16, 4);
                const __m256i xa = _mm256_set1_epi32(a), xb = _mm256_set1_epi32(c);
                for (int u = 0; u < T; u++)
                    s16[r][u] = _mm256_add_epi16(s16[r][u], _mm256_add_epi16(_mm256_maddubs_epi16(lo[u], xa), _mm256_maddubs_epi16(hi[u], xb)));
            }
        }
        for (int u = 0; u < T; u++) {
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wb + u * tstride + 128)));
            const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wb + u * tstride + 144)));
            for (int r = 0; r < R; r++) {
                const __m256 isum = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16[r][u], ones));
                acc[r][u] = _mm256_fmadd_ps(isum, _mm256_mul_ps(d, _mm256_set1_ps(dx[r][bx])), acc[r][u]);
                acc[r][u] = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[r][bx]), acc[r][u]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int u = 0; u < T; u++) {
            const int nc = ncols - 8 * u < 8 ? ncols - 8 * u : 8;
            if (nc == 8) {
                _mm256_storeu_ps(out[r] + 8 * u, acc[r][u]);
            } else {
                float tmp[8];
                _mm256_storeu_ps(tmp, acc[r][u]);
                memcpy(out[r] + 8 * u, tmp, sizeof(float) * nc);
            }
        }
}

#define LB_TILE_FN(R, T)                                                                                                             \
    static void tile_rows_##R##_##T(const uint8_t *w, size_t ts, int nbw, int nbx, const int8_t *const *qx, const float *const *dx, \
                                    const float *const *xs, float *const *out, int nc) {                                             \
        tile_rows(w, ts, nbw, nbx, qx, dx, xs, out, nc, R, T);                                                                       \
    }
LB_TILE_FN(1, 1) LB_TILE_FN(2, 1) LB_TILE_FN(3, 1) LB_TILE_FN(4, 1)
LB_TILE_FN(5, 1) LB_TILE_FN(6, 1) LB_TILE_FN(7, 1) LB_TILE_FN(8, 1)
LB_TILE_FN(1, 2) LB_TILE_FN(2, 2) LB_TILE_FN(3, 2) LB_TILE_FN(4, 2)
typedef void (*tile_fn)(const uint8_t *, size_t, int, int, const int8_t *const *, const float *const *, const float *const *, float *const *, int);
static const tile_fn TILE[3][9] = {{0}, {0, tile_rows_1_1, tile_rows_2_1, tile_rows_3_1, tile_rows_4_1, tile_rows_5_1, tile_rows_6_1, tile_rows_7_1, tile_rows_8_1},
                                   {0, tile_rows_1_2, tile_rows_2_2, tile_rows_3_2, tile_rows_4_2}};

/* Tiles t0..t1-1 for all M rows, two tiles at a time. */
static void run_tiles(const uint8_t *w, int nbw, int nbx, const int8_t *qx, const float *dx, const float *xs, int m, int k, float *y, int n,
                      int t0, int t1) {
    const size_t ts = (size_t)nbw * LB_TILE_BYTES;
    const int wide = m > LB_RS && m <= LB_RW; /* 5..8 rows: all of them in one register block of one tile; else up to 4 rows x 2 tiles */
    const int TS = wide ? 1 : LB_TS, RS = wide ? LB_RW : LB_RS;
    for (int t = t0; t < t1; t += TS) {
        const int T = t1 - t >= TS ? TS : 1;
        const int nc = n - 8 * t < 8 * T ? n - 8 * t : 8 * T;
        for (int r0 = 0; r0 < m; r0 += RS) {
            const int R = m - r0 < RS ? m - r0 : RS;
            const int8_t *q[8];
            const float *d[8], *s[8];
            float *o[8];
            for (int r = 0; r < R; r++) {
                q[r] = qx + (size_t)(r0 + r) * k;
                d[r] = dx + (size_t)(r0 + r) * (k / 32);
                s[r] = xs + (size_t)(r0 + r) * (k / 32);
                o[r] = y + (size_t)(r0 + r) * n + 8 * t;
            }
            TILE[T][R](w + (size_t)t * ts, ts, nbw, nbx, q, d, s, o, nc);
        }
    }
}

/* y (m, n) = x (m, k) @ W^T for W of n outputs and kw = planes * k inputs packed as above. 0 on success; a negative
 * code for arguments it refuses (the Python side checks first and says why). */
int lowbit_gemm(const float *x, int m, int k, const uint8_t *w, int n, int kw, float *y, int threads) {
    if (m <= 0 || k <= 0 || n <= 0 || k % 32 || kw % k || kw < k || threads <= 0) return -1;
    const int nbx = k / 32, nbw = kw / 32, tiles = (n + 7) / 8;
    int8_t *qx = (int8_t *)malloc((size_t)m * k);
    float *dx = (float *)malloc(sizeof(float) * (size_t)m * nbx), *xs = (float *)malloc(sizeof(float) * (size_t)m * nbx);
    if (!qx || !dx || !xs) {
        free(qx), free(dx), free(xs);
        return -2;
    }
    for (int r = 0; r < m; r++) quantize_row(x + (size_t)r * k, k, qx + (size_t)r * k, dx + (size_t)r * nbx, xs + (size_t)r * nbx);
    if (threads > tiles) threads = tiles;
#ifdef _OPENMP
    if (threads > 1) {
#pragma omp parallel num_threads(threads)
        {
            const int nt = omp_get_num_threads(), id = omp_get_thread_num();
            const int t0 = (int)((long)tiles * id / nt), t1 = (int)((long)tiles * (id + 1) / nt);
            run_tiles(w, nbw, nbx, qx, dx, xs, m, k, y, n, t0, t1);
        }
    } else
#endif
        run_tiles(w, nbw, nbx, qx, dx, xs, m, k, y, n, 0, tiles);
    free(qx), free(dx), free(xs);
    return 0;
}

/* ------------------------------------------------------------------------------------------------------------------
 * Row-invariant causal attention (the int4 engine's, next to the GEMM): row i (position T + i) of head h attends
 * over keys 0..T+i of its KV head h / (nh / nkv) with scores q . k * scale, softmax, weighted sum of values. Every
 * (row, head) is computed alone by one thread with the same instructions in the same order, whatever the row count,
 * so a verify's row gets the bits a one-row step gives it (torch's SDPA does not: its GEMMs' kernels change with the
 * query row count, measured). hd: a multiple of 8, at most 256. */

/* exp(x) for x <= 0 (scores minus their max): 2^n * p(r), Cephes' polynomial (as avx_mathfun); fixed arithmetic. */
static inline __m256 exp_neg(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x);
    y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* 8 dot products q . k[j0 + s] (s = 0..7; key indices past last read the last key), hd / 8 vectors each, summed by
 * the same tree in every slot. */
static inline __attribute__((always_inline)) __m256 dots8(const float *q, const float *k, long ks, int j0, int last, int hv) {
    __m256 a[8];
    for (int s = 0; s < 8; s++) {
        const int j = j0 + s <= last ? j0 + s : last;
        const float *kj = k + (long)j * ks;
        __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(kj));
        for (int v = 1; v < hv; v++) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * v), _mm256_loadu_ps(kj + 8 * v), acc);
        a[s] = acc;
    }
    /* hadd tree: slot s ends in lane s */
    __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]), h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
    __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
    /* h0123 = [s0 s1 s2 s3 (low halves) | s0 s1 s2 s3 (high halves)], likewise h4567 */
    __m256 lo = _mm256_permute2f128_ps(h0123, h4567, 0x20), hi = _mm256_permute2f128_ps(h0123, h4567, 0x31);
    return _mm256_add_ps(lo, hi);
}

static inline __attribute__((always_inline)) void attend_body(const float *q, const float *k, const float *v, long ks, int L, const int hv,
                                                               float scale, float *s, float *out) {
    const int nch = (L + 7) / 8;
    __m256 mx = _mm256_set1_ps(-INFINITY);
    const __m256 sc = _mm256_set1_ps(scale);
    for (int c = 0; c < nch; c++) {
        __m256 d = _mm256_mul_ps(dots8(q, k, ks, 8 * c, L - 1, hv), sc);
        if (8 * c + 8 > L) { /* slots past the last key: -inf, so they add nothing */
            const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(8 * c), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            d = _mm256_blendv_ps(d, _mm256_set1_ps(-INFINITY), _mm256_castsi256_ps(_mm256_cmpgt_epi32(idx, _mm256_set1_epi32(L - 1))));
        }
        _mm256_storeu_ps(s + 8 * c, d);
        mx = _mm256_max_ps(mx, d);
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const __m256 m = _mm256_set1_ps(_mm_cvtss_f32(m4));
    __m256 sum = _mm256_setzero_ps();
    for (int c = 0; c < nch; c++) {
        __m256 d = _mm256_loadu_ps(s + 8 * c);
        __m256 e = exp_neg(_mm256_sub_ps(d, m));
        e = _mm256_and_ps(e, _mm256_cmp_ps(d, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ)); /* exactly 0 past the last key */
        _mm256_storeu_ps(s + 8 * c, e);
        sum = _mm256_add_ps(sum, e);
    }
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
    s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    s4 = _mm_add_ss(s4, _mm_movehdup_ps(s4));
    const __m256 inv = _mm256_set1_ps(1.0f / _mm_cvtss_f32(s4));
    __m256 acc[32];
    for (int u = 0; u < hv; u++) acc[u] = _mm256_setzero_ps();
    for (int j = 0; j < L; j++) {
        const __m256 p = _mm256_set1_ps(s[j]);
        const float *vj = v + (long)j * ks;
        for (int u = 0; u < hv; u++) acc[u] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 8 * u), acc[u]);
    }
    for (int u = 0; u < hv; u++) _mm256_storeu_ps(out + 8 * u, _mm256_mul_ps(acc[u], inv));
}

/* One (row, head): the body compiled for a head dim of 64 (hv = 8: the value accumulators stay in registers; with hv
 * known only at run time they lived on the stack) and for any other. The same instructions in the same order, so the
 * same bits; measured on a 2-core AMD EPYC (AVX2), 2026-12-07, 30 layers at 300 keys: 1 row 1.65 -> 1.16 ms, 8 rows
 * 6.53 -> 4.11 ms. */
static void attend_hv8(const float *q, const float *k, const float *v, long ks, int L, float scale, float *s, float *out) {
    attend_body(q, k, v, ks, L, 8, scale, s, out);
}
static void attend_any(const float *q, const float *k, const float *v, long ks, int L, int hv, float scale, float *s, float *out) {
    attend_body(q, k, v, ks, L, hv, scale, s, out);
}
static void attend_one(const float *q, const float *k, const float *v, long ks, int L, int hd, float scale, float *s, float *out) {
    if (hd == 64)
        attend_hv8(q, k, v, ks, L, scale, s, out);
    else
        attend_any(q, k, v, ks, L, hd / 8, scale, s, out);
}

/* q: row i, head h at q + i * qs + h * hd; k, v: KV head g, key j at k + g * hs + j * hd (the StaticKV layout,
 * hs = capacity * hd); y: (n, nh * hd). Row i sees keys 0..T+i. 0 on success. */
int lowbit_attention(const float *q, long qs, int n, int nh, int nkv, int hd, const float *k, const float *v, long hs, int T, int cap,
                     float scale, float *y, int threads) {
    if (n <= 0 || nh <= 0 || nkv <= 0 || nh % nkv || hd <= 0 || hd % 8 || hd > 256 || T < 0 || T + n > cap || threads <= 0) return -1;
    const int g = nh / nkv, items = n * nh;
    float *scratch = (float *)malloc(sizeof(float) * ((size_t)(T + n + 8) * (threads > 1 ? threads : 1)));
    if (!scratch) return -2;
    if (threads > items) threads = items;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
#endif
    for (int it = 0; it < items; it++) {
        const int i = it / nh, h = it % nh;
#ifdef _OPENMP
        float *s = scratch + (size_t)omp_get_thread_num() * (T + n + 8);
#else
        float *s = scratch;
#endif
        attend_one(q + (long)i * qs + (long)h * hd, k + (long)(h / g) * hs, v + (long)(h / g) * hs, hd, T + i + 1, hd, scale, s,
                   y + (long)i * nh * hd + (long)h * hd);
    }
    free(scratch);
    return 0;
}

/* ------------------------------------------------------------------------------------------------------------------
 * The glue between the GEMMs, row by row (one thread: a few microseconds at decode's row counts): each row's
 * instructions and their order are the same whatever n is, so these keep a verify's rows equal to one-row steps. */

/* x (n, H) += y (when y is not NULL), in place; h (n, H) = x * rsqrt(mean(x^2) + eps) * w. H: a multiple of 8. */
int lowbit_add_rmsnorm(float *x, const float *y, const float *w, float *h, int n, int H, float eps) {
    if (n <= 0 || H <= 0 || H % 8) return -1;
    for (int r = 0; r < n; r++) {
        float *xr = x + (size_t)r * H, *hr = h + (size_t)r * H;
        const float *yr = y ? y + (size_t)r * H : NULL;
        __m256 acc = _mm256_setzero_ps();
        for (int j = 0; j < H; j += 8) {
            __m256 v = _mm256_loadu_ps(xr + j);
            if (yr) {
                v = _mm256_add_ps(v, _mm256_loadu_ps(yr + j));
                _mm256_storeu_ps(xr + j, v);
            }
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        s4 = _mm_add_ss(s4, _mm_movehdup_ps(s4));
        const __m256 sc = _mm256_set1_ps(1.0f / sqrtf(_mm_cvtss_f32(s4) / (float)H + eps));
        for (int j = 0; j < H; j += 8)
            _mm256_storeu_ps(hr + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + j), sc), _mm256_loadu_ps(w + j)));
    }
    return 0;
}

/* out (n, I) = silu(gu[:, :I]) * gu[:, I:] for gu (n, 2I): SwiGLU's product. silu(g) = g * sigmoid(g) with
 * sigmoid from exp(-|g|) (the polynomial above). I: a multiple of 8. */
int lowbit_swiglu(const float *gu, int n, int I, float *out) {
    if (n <= 0 || I <= 0 || I % 8) return -1;
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f), zero = _mm256_setzero_ps();
    for (int r = 0; r < n; r++) {
        const float *g = gu + (size_t)r * 2 * I, *u = g + I;
        float *o = out + (size_t)r * I;
        for (int j = 0; j < I; j += 8) {
            const __m256 gv = _mm256_loadu_ps(g + j);
            const __m256 e = exp_neg(_mm256_or_ps(gv, sign)); /* exp(-|g|) */
            const __m256 num = _mm256_blendv_ps(one, e, _mm256_cmp_ps(gv, zero, _CMP_LT_OQ));
            const __m256 sig = _mm256_div_ps(num, _mm256_add_ps(one, e));
            _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(u + j)));
        }
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------------------------------
 * A Llama-style target's decoder layers in one call (the int4 engine's forward without Python between the kernels):
 * per layer  h = RMSNorm(x += pending) ; qkv = h Wqkv^T ; RoPE on q | k (pairs interleaved, as the engine permutes
 * Wqkv's rows) ; K, V into the cache at T.. ; attention ; x += att Wo^T, h = RMSNorm(x) ; pending = SwiGLU(h Wgu^T) Wd^T.
 * The same functions as the calls above, in the same order, so a row's bits are what the per-op path computes with
 * this file's RoPE (both row by row). rope: (n, hd/2) (cos, sin) pairs for positions T..T+n-1. feat (nfeat layer
 * indices, ascending): x after those layers, into feats (n, nfeat * H). 0 on success, negative on refused arguments
 * or a failed allocation. */
int lowbit_layers(float *x, int n, int H, int L, int nh, int nkv, int hd, int I, const uint8_t *const *wqkv, const int *kwqkv,
                  const uint8_t *const *wo, const int *kwo, const uint8_t *const *wgu, const int *kwgu, const uint8_t *const *wd,
                  const int *kwd, const float *const *ln1, const float *const *ln2, float eps, float *const *kc, float *const *vc,
                  int T, int cap, const float *rope, float scale, const int *feat, int nfeat, float *feats, int threads) {
    if (n <= 0 || H <= 0 || H % 32 || L <= 0 || nh <= 0 || nkv <= 0 || nh % nkv || hd <= 0 || hd % 8 || (nh * hd) % 32 || I <= 0 ||
        I % 32 || T < 0 || T + n > cap || nfeat < 0 || threads <= 0)
        return -1;
    const int nq = (nh + 2 * nkv) * hd;
    float *h = (float *)malloc(sizeof(float) * (size_t)n * H), *qkv = (float *)malloc(sizeof(float) * (size_t)n * nq);
    float *att = (float *)malloc(sizeof(float) * (size_t)n * nh * hd), *a = (float *)malloc(sizeof(float) * (size_t)n * H);
    float *gu = (float *)malloc(sizeof(float) * (size_t)n * 2 * I), *act = (float *)malloc(sizeof(float) * (size_t)n * I);
    float *d = (float *)malloc(sizeof(float) * (size_t)n * H);
    int rc = -2, f = 0;
    if (!h || !qkv || !att || !a || !gu || !act || !d) goto done;
    const float *pending = NULL;
    for (int l = 0; l < L; l++) {
        if ((rc = lowbit_add_rmsnorm(x, pending, ln1[l], h, n, H, eps))) goto done;
        if ((rc = lowbit_gemm(h, n, H, wqkv[l], nq, kwqkv[l], qkv, threads))) goto done;
        for (int r = 0; r < n; r++) {
            const float *fr = rope + (size_t)r * hd;
            for (int j = 0; j < nh + nkv; j++) {  /* (re, im) * (c, s): (re c - im s, re s + im c), each product rounded, as torch */
                float *p = qkv + (size_t)r * nq + (size_t)j * hd;
                for (int i = 0; i < hd; i += 8) {
                    const __m256 v = _mm256_loadu_ps(p + i), f = _mm256_loadu_ps(fr + i);
                    const __m256 t1 = _mm256_mul_ps(_mm256_moveldup_ps(v), f);  /* re c, re s */
                    const __m256 t2 = _mm256_mul_ps(_mm256_movehdup_ps(v), _mm256_permute_ps(f, 0xB1));  /* im s, im c */
                    _mm256_storeu_ps(p + i, _mm256_addsub_ps(t1, t2));
                }
            }
            for (int g = 0; g < nkv; g++) {
                memcpy(kc[l] + (size_t)g * cap * hd + (size_t)(T + r) * hd, qkv + (size_t)r * nq + (size_t)(nh + g) * hd, sizeof(float) * hd);
                memcpy(vc[l] + (size_t)g * cap * hd + (size_t)(T + r) * hd, qkv + (size_t)r * nq + (size_t)(nh + nkv + g) * hd, sizeof(float) * hd);
            }
        }
        if ((rc = lowbit_attention(qkv, nq, n, nh, nkv, hd, kc[l], vc[l], (long)cap * hd, T, cap, scale, att, threads))) goto done;
        if ((rc = lowbit_gemm(att, n, nh * hd, wo[l], H, kwo[l], a, threads))) goto done;
        if ((rc = lowbit_add_rmsnorm(x, a, ln2[l], h, n, H, eps))) goto done;
        if ((rc = lowbit_gemm(h, n, H, wgu[l], 2 * I, kwgu[l], gu, threads))) goto done;
        if ((rc = lowbit_swiglu(gu, n, I, act))) goto done;
        if ((rc = lowbit_gemm(act, n, I, wd[l], H, kwd[l], d, threads))) goto done;
        pending = d;
        if (f < nfeat && feat[f] == l) {
            for (size_t e = 0; e < (size_t)n * H; e++) x[e] += d[e];
            pending = NULL;
            for (int r = 0; r < n; r++) memcpy(feats + ((size_t)r * nfeat + f) * H, x + (size_t)r * H, sizeof(float) * H);
            f++;
        }
    }
    if (pending)
        for (size_t e = 0; e < (size_t)n * H; e++) x[e] += pending[e];
    rc = 0;
done:
    free(h), free(qkv), free(att), free(a), free(gu), free(act), free(d);
    return rc;
}
