/* Multi-LoRA for one projection, token by token: y[t] += sum_k w[t][k] * (x[t] @ A[s]) @ B[s], s = slot[t][k].
 *
 * Each token carries `parts` (slot, weight) pairs: one for a plain adapter (its weight the scale
 * vLLM passes), several for a mix of adapters each at its own scale (``inference.engine.mixes``), so a
 * batch can hold plain, scaled and mixed requests side by side and each gets its own delta.
 *
 * The adapter weights are held in half precision (IEEE fp16, converted with F16C) and the arithmetic
 * is float32. A decode batch of many adapters is bound by the bytes of adapter weights read, one
 * slot's per token and part (inference/engine/__init__.py says why); half precision halves them.
 *
 * Layouts (row-major, contiguous):
 *   a: slots x K x in       K = slices * rank: row k of a slot is rank component k % rank of slice k / rank
 *   b: slots x rank x out   out = offsets[slices]: slice i's columns are offsets[i] .. offsets[i + 1]
 *   slot, weight: tokens x parts (int64, float32); weight NULL: every pair weighs `scale`
 * y and x: one row per token, float32, rows `y_stride` / `x_stride` floats apart.
 * A pair whose slot is negative adds nothing.
 */
#include <immintrin.h>
#include <stdint.h>

static inline __m256 load_half8(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}

/* h[j] = scale * x . a[j] for the `count` (1 to 4) rows a[j] = a + j * n: x is loaded once for all of
 * them, and each row has an accumulator of its own, so the FMAs do not wait on one another. */
static void dot_rows(const float *x, const uint16_t *a, int64_t n, int64_t count, float scale, float *h) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    int64_t i = 0;
    if (count == 4) {
        for (; i + 8 <= n; i += 8) {
            __m256 xs = _mm256_loadu_ps(x + i);
            acc[0] = _mm256_fmadd_ps(xs, load_half8(a + i), acc[0]);
            acc[1] = _mm256_fmadd_ps(xs, load_half8(a + n + i), acc[1]);
            acc[2] = _mm256_fmadd_ps(xs, load_half8(a + 2 * n + i), acc[2]);
            acc[3] = _mm256_fmadd_ps(xs, load_half8(a + 3 * n + i), acc[3]);
        }
    } else {
        for (; i + 8 <= n; i += 8) {
            __m256 xs = _mm256_loadu_ps(x + i);
            for (int64_t j = 0; j < count; j++) acc[j] = _mm256_fmadd_ps(xs, load_half8(a + j * n + i), acc[j]);
        }
    }
    for (int64_t j = 0; j < count; j++) {
        float total = sum8(acc[j]);
        for (int64_t tail = i; tail < n; tail++) total += x[tail] * half_to_float(a[j * n + tail]);
        h[j] = scale * total;
    }
}

/* y[begin..end) += sum_k h[k] * b[k][begin..end), b's rows `stride` apart: 32 outputs at a time (four
 * independent sums sharing each broadcast h[k]), then 8, then one; each output summed over k in order. */
static void add_combination(float *y, const float *h, const uint16_t *b, int64_t rank, int64_t stride,
                            int64_t begin, int64_t end) {
    int64_t o = begin;
    for (; o + 32 <= end; o += 32) {
        __m256 acc0 = _mm256_loadu_ps(y + o), acc1 = _mm256_loadu_ps(y + o + 8);
        __m256 acc2 = _mm256_loadu_ps(y + o + 16), acc3 = _mm256_loadu_ps(y + o + 24);
        for (int64_t k = 0; k < rank; k++) {
            const uint16_t *row = b + k * stride + o;
            __m256 hk = _mm256_set1_ps(h[k]);
            acc0 = _mm256_fmadd_ps(hk, load_half8(row), acc0);
            acc1 = _mm256_fmadd_ps(hk, load_half8(row + 8), acc1);
            acc2 = _mm256_fmadd_ps(hk, load_half8(row + 16), acc2);
            acc3 = _mm256_fmadd_ps(hk, load_half8(row + 24), acc3);
        }
        _mm256_storeu_ps(y + o, acc0);
        _mm256_storeu_ps(y + o + 8, acc1);
        _mm256_storeu_ps(y + o + 16, acc2);
        _mm256_storeu_ps(y + o + 24, acc3);
    }
    for (; o + 8 <= end; o += 8) {
        __m256 acc = _mm256_loadu_ps(y + o);
        for (int64_t k = 0; k < rank; k++)
            acc = _mm256_fmadd_ps(_mm256_set1_ps(h[k]), load_half8(b + k * stride + o), acc);
        _mm256_storeu_ps(y + o, acc);
    }
    for (; o < end; o++) {
        float total = y[o];
        for (int64_t k = 0; k < rank; k++) total += h[k] * half_to_float(b[k * stride + o]);
        y[o] = total;
    }
}

static void one_token(float *y, const float *x, const uint16_t *a, const uint16_t *b, int64_t in, int64_t rank,
                      int64_t slices, const int64_t *offsets, float scale) {
    int64_t components = slices * rank, out = offsets[slices];
    float h[components]; /* at most 3 slices x vLLM's largest max_lora_rank: a few KiB */
    for (int64_t k = 0; k < components; k += 4)
        dot_rows(x, a + k * in, in, components - k < 4 ? components - k : 4, scale, h + k);
    for (int64_t i = 0; i < slices; i++) add_combination(y, h + i * rank, b, rank, out, offsets[i], offsets[i + 1]);
}

void lora_gemv(float *y, int64_t y_stride, const float *x, int64_t x_stride, const int64_t *slot,
               const float *weight, int64_t parts, int64_t tokens, const uint16_t *a, const uint16_t *b, int64_t in,
               int64_t rank, int64_t slices, const int64_t *offsets, float scale) {
    int64_t a_slot = slices * rank * in, b_slot = rank * offsets[slices];
#pragma omp parallel for schedule(static) if (tokens >= 4)
    for (int64_t t = 0; t < tokens; t++) {
        for (int64_t k = 0; k < parts; k++) {
            int64_t s = slot[t * parts + k];
            if (s < 0) continue;
            float w = weight ? scale * weight[t * parts + k] : scale;
            one_token(y + t * y_stride, x + t * x_stride, a + s * a_slot, b + s * b_slot, in, rank, slices, offsets,
                      w);
        }
    }
}

static inline int64_t count_infinite(__m128i h) {
    __m128i magnitude = _mm_and_si128(h, _mm_set1_epi16(0x7fff));
    return __builtin_popcount(_mm_movemask_epi8(_mm_cmpeq_epi16(magnitude, _mm_set1_epi16(0x7c00)))) / 2;
}

/* dst[r][c] = src[r][c] rounded to half precision (to nearest, ties to even, as torch's .half()), for
 * r < rows and c < cols, strides in elements: a slot's weights copied from vLLM's float32 layout.
 * Eight at a time where the target's rows or columns are contiguous (the second: vLLM's B, out x
 * rank, into ours, rank x out). Returns how many became infinite (past half precision's range). */
int64_t to_half(uint16_t *dst, int64_t dst_row, int64_t dst_col, const float *src, int64_t src_row, int64_t src_col,
                int64_t rows, int64_t cols) {
    int64_t infinite = 0;
    if (dst_row == 1 && src_col == 1 && src_row > 0 && src_row < (1 << 27)) { /* transposed: gather 8 rows */
        __m256i rows8 = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int)src_row));
        for (int64_t c = 0; c < cols; c++) {
            uint16_t *out = dst + c * dst_col;
            int64_t r = 0;
            for (; r + 8 <= rows; r += 8) {
                __m128i h = _mm256_cvtps_ph(_mm256_i32gather_ps(src + r * src_row + c, rows8, 4), _MM_FROUND_TO_NEAREST_INT);
                _mm_storeu_si128((__m128i *)(out + r), h);
                infinite += count_infinite(h);
            }
            for (; r < rows; r++) {
                uint16_t h = _cvtss_sh(src[r * src_row + c], _MM_FROUND_TO_NEAREST_INT);
                out[r] = h;
                infinite += (h & 0x7fff) == 0x7c00;
            }
        }
        return infinite;
    }
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *out = dst + r * dst_row;
        const float *in = src + r * src_row;
        int64_t c = 0;
        if (dst_col == 1 && src_col == 1) {
            for (; c + 8 <= cols; c += 8) {
                __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(in + c), _MM_FROUND_TO_NEAREST_INT);
                _mm_storeu_si128((__m128i *)(out + c), h);
                infinite += count_infinite(h);
            }
        }
        for (; c < cols; c++) {
            uint16_t h = _cvtss_sh(in[c * src_col], _MM_FROUND_TO_NEAREST_INT);
            out[c * dst_col] = h;
            infinite += (h & 0x7fff) == 0x7c00;
        }
    }
    return infinite;
}

/* A slot swap in one call: for each slot of `slots` and each of the `entries` rows of `table`
 * (dst, dst_slot, dst_row, dst_col, src, src_slot, src_row, src_col, rows, cols: pointers as
 * integers, strides in elements), to_half of that slot's matrix. infinite[k]: how many values of
 * slots[k] became infinite. */
void to_half_slots(const int64_t *table, int64_t entries, const int64_t *slots, int64_t count, int64_t *infinite) {
    for (int64_t k = 0; k < count; k++) {
        int64_t slot = slots[k], total = 0;
        for (int64_t e = 0; e < entries; e++) {
            const int64_t *row = table + e * 10;
            uint16_t *dst = (uint16_t *)(intptr_t)row[0] + slot * row[1];
            const float *src = (const float *)(intptr_t)row[4] + slot * row[5];
            total += to_half(dst, row[2], row[3], src, row[6], row[7], row[8], row[9]);
        }
        infinite[k] = total;
    }
}
