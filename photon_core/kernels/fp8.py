"""FP8 e4m3 weights decoded in a kernel, the same way on every GPU and under the interpreter.

Moondream 3's experts are float8_e4m3fn bytes with an fp32 scale per output row. Triton's own
fp8e4nv conversion needs sm_89+ (a Jetson Orin is sm_87) and the interpreter has none, so the bytes
are decoded with integer ops and one fp16 conversion (fp8_e4m3_over_256), to 2^-8 of their value;
a kernel multiplies each output row's sum by FP8_UNSCALE x its scale after its K loop.
"""
import triton
import triton.language as tl

# FP8 e4m3 bytes decode to (value * 2^-8) exactly (fp8_e4m3_over_256); the scale epilogue puts it back.
FP8_UNSCALE: tl.constexpr = tl.constexpr(256.0)


@triton.jit
def fp8_e4m3_over_256(b):
    """float8_e4m3fn bytes (any integer type) -> their values times 2^-8, as fp32, with integer ops
    and an fp16 conversion. e4m3's sign | 4-bit exponent | 3-bit mantissa placed as fp16's
    sign | low 4 exponent bits | top 3 mantissa bits is the same number with exponent bias 15
    instead of 7: exact for every finite value, subnormals included (NaN bytes decode as 480/256)."""
    b = b.to(tl.uint16)
    h = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
    return h.to(tl.float16, bitcast=True).to(tl.float32)
