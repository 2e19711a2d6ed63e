// One 32-value block of q8_1 activations (what gemv_quant reads), quantized by the warp that
// holds it, one value a lane (lane l holds value l of the block at `index`, so `index % 32`
// is the lane): d = amax / 127, q = round(x * (1 / d)) to nearest even within +-127, and
// (d, d * sum q) at the block's slot. Shared by `quantize_q8_rows` and the producers that
// write their output quantized besides (`rms_norm_q8`, `silu_mul_q8`): one definition, so the
// fused and the separate quantizer give the same bytes. The whole warp must call it.
PAGODA_DEVICE void q8_quantize_block(float value, signed char* __restrict__ xq,
                                     float2* __restrict__ xds, size_t index) {
    const float amax = warp_max(fabsf(value));
    const float d = amax / 127.0f;
    const float inverse = d != 0.0f ? 1.0f / d : 0.0f;
    const int q = max(-127, min(127, __float2int_rn(value * inverse)));
    xq[index] = (signed char)q;
    const int sum = __reduce_add_sync(0xffffffffu, q);
    if (index % 32 == 0) xds[index / 32] = make_float2(d, d * (float)sum);
}
