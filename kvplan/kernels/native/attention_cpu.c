/* Decode attention over kvplan's packed blocks on the CPU: the two per-token loops of
 * kvplan/kernels/attention_native.py, compiled at first use (kvplan/kernels/native_build.py).
 *
 * Layouts are those of kvplan/kernels/reference.py (the PyTorch reference these loops are
 * tested against): packed codes uint8 [B, h, T, row_bytes] with code j of a pack unit at bit
 * j * bits (little-endian across a 3-bit unit's three bytes); per-group scale and zero given
 * here as fp32 (the caller converts the stored fp16 / e4m3), channel axis [B, h, n_groups, D]
 * (groups of `group` tokens, the first token at `start_offset` inside its group), token axis
 * [B, h, T, D / group] (groups of `group` channels). Decoded value = zero + scale * L[code],
 * L given per byte value by `lut` (see row_levels below), zero = NULL for symmetric formats.
 *
 * Keys (kvp_key_scores): TILE tokens at a time are decoded into a channel-major tile
 * x[D][TILE] (uniform channel-axis codes by a byte transpose, tile_uniform_channel; others one
 * value at a time), so every later pass is a plain vector operation over TILE tokens: the
 * unnormalized fast Walsh-Hadamard transform (log2 D butterfly passes; the caller folds
 * 1/sqrt(D) into the query), RoPE on the rotate-half pairs (i, i + half) at the tokens' own
 * angles (the caller passes the cos / sin tables transposed, [half][T]), then the dot products
 * with the query rows, four at a time. Post-RoPE keys never exist beyond one tile.
 *
 * Values (kvp_value_accum): token axis at 2 / 4 bits, TILE channels of every token at a time
 * with the sums of four query rows in registers (values_lanes); otherwise one token at a time,
 * decoded into a row v[D], then acc[r][:] += p[r][t] * v[:].
 *
 * One call runs on one thread (the caller splits long runs over threads); no allocation (stack
 * buffers of at most MAX_D channels).
 */
#include <stdint.h>
#include <string.h>

#define TILE 16
#define MAX_D 256

/* TILE floats (or bytes) as one vector (GCC / Clang vector extension; split into the machine's widths) */
typedef float vtile __attribute__((vector_size(TILE * sizeof(float))));
typedef uint8_t vbytes __attribute__((vector_size(TILE)));
typedef int32_t vint __attribute__((vector_size(TILE * sizeof(int32_t))));

/* Interleave the low (high) halves of two byte vectors: a0 b0 a1 b1 ... (a8 b8 a9 b9 ...). */
#if defined(__clang__)
#define INTERLEAVE_LO(a, b) __builtin_shufflevector(a, b, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23)
#define INTERLEAVE_HI(a, b) __builtin_shufflevector(a, b, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31)
#else
#define INTERLEAVE_LO(a, b) \
    __builtin_shuffle(a, b, (vbytes){0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23})
#define INTERLEAVE_HI(a, b) \
    __builtin_shuffle(a, b, (vbytes){8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31})
#endif

/* Transpose a 16 x 16 byte matrix held as 16 row vectors: four rounds of the perfect shuffle
 * (row 2i <- interleave_lo(row i, row i + 8), row 2i + 1 <- interleave_hi(...)). */
static inline void transpose_16x16(vbytes *r) {
    vbytes t[16];
    for (int round = 0; round < 4; round++) {
        for (int i = 0; i < 8; i++) {
            t[2 * i] = INTERLEAVE_LO(r[i], r[i + 8]);
            t[2 * i + 1] = INTERLEAVE_HI(r[i], r[i + 8]);
        }
        memcpy(r, t, sizeof(t));
    }
}

/* Channel-axis runs with uniform levels (L[c] = c) at 2, 4 or 8 bits, the n <= TILE tokens of
 * one token group: decode straight into the channel-major tile. The rows' bytes are transposed 16
 * at a time (16 tokens x 16 bytes), so byte i of the n tokens is one vector whose codes are shifted
 * out, converted and scaled as whole vectors. */
static void tile_uniform_channel(vtile *x, const uint8_t *rows, int64_t cs_t, int n, int bits, int D,
                                 const float *s, const float *z) {
    const int per_byte = 8 / bits, row_bytes = (D + per_byte - 1) / per_byte;
    const int mask = (1 << bits) - 1;
    vbytes col[TILE];
    for (int c0 = 0; c0 < row_bytes; c0 += TILE) {
        const int w = row_bytes - c0 < TILE ? row_bytes - c0 : TILE;
        for (int j = 0; j < TILE; j++) {
            if (j < n && w == TILE) {
                memcpy(&col[j], rows + (int64_t)j * cs_t + c0, TILE); /* one vector load */
            } else {
                col[j] = (vbytes){0};
                if (j < n) memcpy(&col[j], rows + (int64_t)j * cs_t + c0, w);
            }
        }
        transpose_16x16(col); /* col[i]: byte c0 + i of the n tokens */
        for (int i = 0; i < w; i++) {
            const vint wide = __builtin_convertvector(col[i], vint); /* shifts in 32-bit lanes (x86 has no byte shifts) */
            for (int k = 0; k < per_byte; k++) {
                const int d = (c0 + i) * per_byte + k;
                if (d >= D) break;
                const vtile lv = __builtin_convertvector((wide >> (k * bits)) & mask, vtile);
                x[d] = z ? lv * s[d] + z[d] : lv * s[d];
            }
        }
    }
}

/* Rows r0 .. r0 + 3 of a [R, *] array (rows past R repeat row r0, their sums are not written):
 * the loops take four rows at a time so that four independent sums stay in registers. Returns
 * how many of the four are real. */
static inline int four_rows(const float *base, int64_t stride, int r0, int R, const float **r_0, const float **r_1,
                            const float **r_2, const float **r_3) {
    const int m = R - r0 < 4 ? R - r0 : 4;
    *r_0 = base + r0 * stride;
    *r_1 = base + (r0 + (m > 1 ? 1 : 0)) * stride;
    *r_2 = base + (r0 + (m > 2 ? 2 : 0)) * stride;
    *r_3 = base + (r0 + (m > 3 ? 3 : 0)) * stride;
    return m;
}

/* Levels of one packed row into v[0 .. D) (v holds MAX_D + 8 floats: a 2-bit row of D % 4 != 0
 * writes up to 3 floats past D). lut: bits 2 -> [256][4] levels of the four codes of each
 * byte value; 4 -> [256][2]; 8 -> [256]; 3 -> the 8 levels themselves. */
static inline void row_levels(const uint8_t *row, int bits, int D, const float *lut, float *v) {
    if (bits == 2) {
        for (int i = 0; i < (D + 3) / 4; i++) memcpy(v + 4 * i, lut + 4 * row[i], 4 * sizeof(float));
    } else if (bits == 4) {
        for (int i = 0; i < (D + 1) / 2; i++) memcpy(v + 2 * i, lut + 2 * row[i], 2 * sizeof(float));
    } else if (bits == 8) {
        for (int i = 0; i < D; i++) v[i] = lut[row[i]];
    } else { /* 3 bits: units of three bytes holding eight codes */
        for (int u = 0; u < (D + 7) / 8; u++) {
            uint32_t w = (uint32_t)row[3 * u] | ((uint32_t)row[3 * u + 1] << 8) | ((uint32_t)row[3 * u + 2] << 16);
            for (int k = 0; k < 8; k++) v[8 * u + k] = lut[(w >> (3 * k)) & 7u];
        }
    }
}

/* Dequantize levels v[0 .. D) of token t in place: channel axis (scale / zero rows of its
 * token group, D each) or token axis (one scale / zero per `group` channels). */
static inline void affine_row(float *v, int D, int axis_channel, int group, const float *s, const float *z) {
    if (axis_channel) {
        if (z) {
            for (int d = 0; d < D; d++) v[d] = v[d] * s[d] + z[d];
        } else {
            for (int d = 0; d < D; d++) v[d] = v[d] * s[d];
        }
        return;
    }
    for (int g0 = 0, gi = 0; g0 < D; g0 += group, gi++) {
        const float sv = s[gi], zv = z ? z[gi] : 0.0f;
        if (z) {
            for (int d = g0; d < g0 + group; d++) v[d] = v[d] * sv + zv;
        } else {
            for (int d = g0; d < g0 + group; d++) v[d] = v[d] * sv;
        }
    }
}

/* The scale / zero rows of token t (pointers into the fp32 tensors). */
static inline void group_rows(int t, int axis_channel, int group, int start_offset, const float *scale,
                              const float *zero, int64_t ss_g, const float **s, const float **z) {
    int64_t gi = axis_channel ? (start_offset + t) / group : t;
    *s = scale + gi * ss_g;
    *z = zero ? zero + gi * ss_g : NULL;
}

/* scores[b, h, r, t] = q[b, h, r, :] . key_t for the T tokens of one packed run.
 *
 * key_t: the stored value read back; with `hadamard` the unnormalized FWHT of it (pass the
 * query times 1/sqrt(D)); with `rope_half` > 0 the rotate-half pairs (i, i + rope_half),
 * i < rope_half, turned by the angles cos_t[i * cs_f + t], sin_t[i * cs_f + t] (t: the token's
 * index inside this run; the caller offsets the tables to the run's first cache index), plus
 * row_shift[b] for batch row b when `row_shift` is given (a left-padded batch: each row at its
 * own RoPE positions; the tables then hold T + max(row_shift) columns).
 * `accumulate`: add to out instead of writing it (the key correction's scores); `uniform`: the
 * levels are the codes themselves (L[c] = c; `lut` is still given). Strides are in elements (codes: bytes); the last dimension of codes, scale, zero, q and out
 * is contiguous. */
void kvp_key_scores(int B, int H, int T, int D, int R,
                    const uint8_t *codes, int64_t cs_b, int64_t cs_h, int64_t cs_t,
                    int bits, const float *lut,
                    const float *scale, const float *zero, int64_t ss_b, int64_t ss_h, int64_t ss_g,
                    int axis_channel, int group, int start_offset,
                    const float *q, int64_t qs_b, int64_t qs_h, int64_t qs_r,
                    int hadamard, int rope_half, const float *cos_t, const float *sin_t, int64_t cs_f,
                    const int64_t *row_shift, float *out, int64_t os_b, int64_t os_h, int64_t os_r, int accumulate, int uniform) {
    vtile x[MAX_D]; /* x[d]: channel d of the tile's TILE tokens */
    const int fast = uniform && axis_channel && bits != 3;
    float v[MAX_D + 8];
    memset(x, 0, sizeof(x));
    for (int b = 0; b < B; b++) {
        for (int h = 0; h < H; h++) {
            const uint8_t *cb = codes + b * cs_b + h * cs_h;
            const float *sb = scale + b * ss_b + h * ss_h;
            const float *zb = zero ? zero + b * ss_b + h * ss_h : NULL;
            const float *qb = q + b * qs_b + h * qs_h;
            float *ob = out + b * os_b + h * os_h;
            const int64_t shift = row_shift ? row_shift[b] : 0;
            const float *cos_b = cos_t ? cos_t + shift : NULL, *sin_b = sin_t ? sin_t + shift : NULL;
            for (int t0 = 0, n; t0 < T; t0 += n) {
                n = T - t0 < TILE ? T - t0 : TILE;
                if (fast) { /* a tile ends at its token group's end */
                    const int left = group - (start_offset + t0) % group;
                    n = n < left ? n : left;
                    const float *s, *z;
                    group_rows(t0, axis_channel, group, start_offset, sb, zb, ss_g, &s, &z);
                    tile_uniform_channel(x, cb + (int64_t)t0 * cs_t, cs_t, n, bits, D, s, z);
                } else {
                    float *xs = (float *)x;
                    for (int j = 0; j < n; j++) {
                        const float *s, *z;
                        group_rows(t0 + j, axis_channel, group, start_offset, sb, zb, ss_g, &s, &z);
                        row_levels(cb + (int64_t)(t0 + j) * cs_t, bits, D, lut, v);
                        affine_row(v, D, axis_channel, group, s, z);
                        for (int d = 0; d < D; d++) xs[d * TILE + j] = v[d];
                    }
                }
                if (hadamard) {
                    for (int st = 1; st < D; st <<= 1) {
                        for (int i0 = 0; i0 < D; i0 += 2 * st) {
                            for (int i = i0; i < i0 + st; i++) {
                                const vtile a = x[i], c = x[i + st];
                                x[i] = a + c;
                                x[i + st] = a - c;
                            }
                        }
                    }
                }
                for (int i = 0; i < rope_half; i++) {
                    vtile c, sn;
                    if (n == TILE) { /* vector loads */
                        memcpy(&c, cos_b + i * cs_f + t0, sizeof(c));
                        memcpy(&sn, sin_b + i * cs_f + t0, sizeof(sn));
                    } else { /* a short tile: the tables may end at T */
                        c = sn = (vtile){0};
                        memcpy(&c, cos_b + i * cs_f + t0, n * sizeof(float));
                        memcpy(&sn, sin_b + i * cs_f + t0, n * sizeof(float));
                    }
                    const vtile a = x[i], e = x[i + rope_half];
                    x[i] = a * c - e * sn;
                    x[i + rope_half] = e * c + a * sn;
                }
                /* four query rows at a time: four independent accumulators stay in registers */
                for (int r0 = 0; r0 < R; r0 += 4) {
                    const float *q0, *q1, *q2, *q3;
                    const int m = four_rows(qb, qs_r, r0, R, &q0, &q1, &q2, &q3);
                    vtile a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
                    for (int d = 0; d < D; d++) {
                        const vtile xd = x[d];
                        a0 += q0[d] * xd;
                        a1 += q1[d] * xd;
                        a2 += q2[d] * xd;
                        a3 += q3[d] * xd;
                    }
                    const vtile *accs[4] = {&a0, &a1, &a2, &a3};
                    for (int k = 0; k < m; k++) {
                        float *o = ob + (r0 + k) * os_r + t0;
                        const float *ak = (const float *)accs[k];
                        if (accumulate) {
                            for (int j = 0; j < n; j++) o[j] += ak[j];
                        } else {
                            memcpy(o, ak, n * sizeof(float));
                        }
                    }
                }
            }
        }
    }
}

/* Values of one head, token axis, 2 or 4 bits, channel groups of a multiple of TILE channels:
 * TILE channels of every token at a time, so four query rows' sums stay in registers. The TILE
 * codes of a chunk are one 32-bit word (2 bits) or two (4 bits), spread over the lanes by one
 * variable shift; levels come from a lane permute of the codebook (GCC) or a table read. */
static void values_lanes(int T, int D, int R, const uint8_t *cb, int64_t cs_t, int bits, const float *levels,
                         int uniform, const float *sb, const float *zb, int64_t ss_g, int group,
                         const float *pb, int64_t ps_r, float *ab, int64_t as_r) {
    vint shift;
    for (int l = 0; l < TILE; l++) shift[l] = (bits * l) % 32;
    const int mask = (1 << bits) - 1;
    vtile lvec = {0};
    for (int c = 0; c <= mask; c++) lvec[c] = levels[c];
    for (int d0 = 0; d0 < D; d0 += TILE) {
        const int gi = d0 / group, byte0 = d0 * bits / 8;
        for (int r0 = 0; r0 < R; r0 += 4) {
            const float *p0, *p1, *p2, *p3;
            const int m = four_rows(pb, ps_r, r0, R, &p0, &p1, &p2, &p3);
            vtile a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (int t = 0; t < T; t++) {
                const uint8_t *row = cb + (int64_t)t * cs_t + byte0;
                uint32_t w0, w1 = 0;
                memcpy(&w0, row, 4);
                if (bits == 4) memcpy(&w1, row + 4, 4);
                vint words;
                for (int l = 0; l < TILE; l++) words[l] = (int32_t)(bits == 4 && l >= 8 ? w1 : w0);
                const vint codes = (vint)((uint32_t __attribute__((vector_size(TILE * 4))))words >>
                                          (uint32_t __attribute__((vector_size(TILE * 4))))shift) & mask;
                vtile lv;
                if (uniform) {
                    lv = __builtin_convertvector(codes, vtile);
                } else {
#if defined(__clang__)
                    for (int l = 0; l < TILE; l++) lv[l] = lvec[codes[l]];
#else
                    lv = __builtin_shuffle(lvec, codes);
#endif
                }
                const float *st = sb + (int64_t)t * ss_g;
                const vtile val = zb ? lv * st[gi] + zb[(int64_t)t * ss_g + gi] : lv * st[gi];
                a0 += p0[t] * val;
                a1 += p1[t] * val;
                a2 += p2[t] * val;
                a3 += p3[t] * val;
            }
            const vtile *accs[4] = {&a0, &a1, &a2, &a3};
            for (int k = 0; k < m; k++) {
                float *o = ab + (r0 + k) * as_r + d0;
                for (int l = 0; l < TILE; l++) o[l] += (*accs[k])[l];
            }
        }
    }
}

/* acc[b, h, r, :] += sum_t p[b, h, r, t] * value_t for the T tokens of one packed run
 * (value_t: the stored value read back, in the stored frame). Strides as kvp_key_scores;
 * `levels`: the 2**bits levels (`uniform`: they are the codes). */
void kvp_value_accum(int B, int H, int T, int D, int R,
                     const uint8_t *codes, int64_t cs_b, int64_t cs_h, int64_t cs_t,
                     int bits, const float *lut,
                     const float *scale, const float *zero, int64_t ss_b, int64_t ss_h, int64_t ss_g,
                     int axis_channel, int group, int start_offset,
                     const float *p, int64_t ps_b, int64_t ps_h, int64_t ps_r,
                     float *acc, int64_t as_b, int64_t as_h, int64_t as_r, const float *levels, int uniform) {
    float v[MAX_D + 8];
    const int lanes = !axis_channel && (bits == 2 || bits == 4) && D % TILE == 0 && group % TILE == 0;
    for (int b = 0; b < B; b++) {
        for (int h = 0; h < H; h++) {
            const uint8_t *cb = codes + b * cs_b + h * cs_h;
            const float *sb = scale + b * ss_b + h * ss_h;
            const float *zb = zero ? zero + b * ss_b + h * ss_h : NULL;
            const float *pb = p + b * ps_b + h * ps_h;
            float *ab = acc + b * as_b + h * as_h;
            if (lanes) {
                values_lanes(T, D, R, cb, cs_t, bits, levels, uniform, sb, zb, ss_g, group, pb, ps_r, ab, as_r);
                continue;
            }
            for (int t = 0; t < T; t++) {
                const float *s, *z;
                group_rows(t, axis_channel, group, start_offset, sb, zb, ss_g, &s, &z);
                row_levels(cb + (int64_t)t * cs_t, bits, D, lut, v);
                affine_row(v, D, axis_channel, group, s, z);
                for (int r = 0; r < R; r++) {
                    const float pr = pb[r * ps_r + t];
                    float *ar = ab + r * as_r;
                    for (int d = 0; d < D; d++) ar[d] += pr * v[d];
                }
            }
        }
    }
}

/* Error-feedback slot codes (kvplan/kernels/feedback.py, whose PyTorch loop this is, bit for bit):
 * x, s, z: fp32 [N][D] row-major (row n = token (b, head, t) of a [B, h, T, D] block, head =
 * (n / T) % h; s, z the scale / zero-point of each value), z = NULL for symmetric formats;
 * order int64 [h][D] (the coding order of each head's coordinates); levels [n_levels], mids
 * [n_levels - 1]; factor fp32 [h][D][D] (upper Cholesky factor of the inverse metric, coding
 * order). Writes codes uint8 [N][D] (the channels' own order). Each rounding is done as the
 * PyTorch ops do it (no fused multiply-add), so the codes are the same.
 *
 * FB_LANES tokens of one head are coded at once, one per SIMD lane: coordinate d of every lane is
 * coded, then the rank-1 push w[j][lane] -= U[d][j] * err[lane] (j > d) runs across the lanes, so
 * the serial chain of one token's coordinates is spread over independent tokens. */
#define FB_LANES 8
typedef float fb_vec __attribute__((vector_size(4 * FB_LANES)));
typedef int32_t fb_ivec __attribute__((vector_size(4 * FB_LANES)));
static const fb_vec fb_zero = {0};
#pragma STDC FP_CONTRACT OFF
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
static void feedback_lanes(int D, const float *U, fb_vec *w, const fb_vec *sv,
                           const fb_vec *zv, int has_z, const float *levels, const float *mids,
                           int n_mids, uint8_t out[][FB_LANES]) {
    for (int d = 0; d < D; d++) {
        const float diag = U[(int64_t)d * D + d];
        const fb_vec sc = sv[d];
        fb_vec safe;
        for (int l = 0; l < FB_LANES; l++) safe[l] = sc[l] > 0.0f ? sc[l] : 1.0f;
        const fb_vec q = (has_z ? w[d] - zv[d] : w[d]) / safe;
        fb_ivec cnt;
        fb_vec lv;
        if (n_mids <= 16) {  /* torch.bucketize(q, mids), right=False: the count of mids below q */
            cnt = (fb_ivec){0};
            lv = fb_zero + levels[0];
            for (int j = 0; j < n_mids; j++) {  /* mids ascend: the last mid below q picks the level */
                const fb_ivec below = (fb_ivec)(mids[j] < q);  /* -1 where below, else 0 */
                const fb_vec next = fb_zero + levels[j + 1];
                cnt -= below;
                lv = (fb_vec)(((fb_ivec)lv & ~below) | ((fb_ivec)next & below));
            }
        } else {  /* the same count by bisection (a NaN q counts 0 either way) */
            for (int l = 0; l < FB_LANES; l++) {
                int lo = 0, hi = n_mids;
                while (lo < hi) { const int mid = (lo + hi) / 2; if (mids[mid] < q[l]) lo = mid + 1; else hi = mid; }
                cnt[l] = lo; lv[l] = levels[lo];
            }
        }
        for (int l = 0; l < FB_LANES; l++) out[d][l] = (uint8_t)(sc[l] > 0.0f ? cnt[l] : 0);
        fb_vec read = lv * sc;
        if (has_z) read = read + zv[d];
        const fb_vec err = (w[d] - read) / diag;
        const float *Ud = U + (int64_t)d * D;
        for (int j = d + 1; j < D; j++) w[j] -= Ud[j] * err;
    }
}

void kvp_feedback_codes(int D, int64_t N, int h, int64_t T, const float *x, const float *s, const float *z,
                        const int64_t *order, const float *levels, const float *mids, int n_mids,
                        const float *factor, uint8_t *codes) {
    fb_vec w[MAX_D], sv[MAX_D], zv[MAX_D];
    uint8_t out[MAX_D][FB_LANES];
    for (int64_t run = 0; run < N; run += T) {  /* tokens run .. run + T - 1 share one head */
        const int64_t head = (run / T) % h;
        const float *U = factor + head * (int64_t)D * D;
        const int64_t *ord = order + head * D;
        for (int64_t n0 = run; n0 < run + T; n0 += FB_LANES) {
            const int lanes = (int)(run + T - n0 < FB_LANES ? run + T - n0 : FB_LANES);
            for (int l = 0; l < FB_LANES; l++) {  /* spare lanes: zero scale, code 0, discarded */
                const int64_t row = (n0 + l) * D;
                for (int d = 0; d < D; d++) {
                    w[d][l] = l < lanes ? x[row + ord[d]] : 0.0f;
                    sv[d][l] = l < lanes ? s[row + ord[d]] : 0.0f;
                    zv[d][l] = (z && l < lanes) ? z[row + ord[d]] : 0.0f;
                }
            }
            feedback_lanes(D, U, w, sv, zv, z != NULL, levels, mids, n_mids, out);
            for (int l = 0; l < lanes; l++)
                for (int d = 0; d < D; d++) codes[(n0 + l) * D + ord[d]] = out[d][l];
        }
    }
}
